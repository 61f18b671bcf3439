//! rediss:// set-ups for tests: a throwaway CA with a server and a client certificate (made with
//! the `openssl` command), and a redis-server serving TLS with an ACL user.
//!
//! ```no_run
//! # async fn demo() {
//! use sluicegate_testkit::tls::{have_openssl, tls_redis, Pki};
//!
//! if !have_openssl() {
//!     return;
//! }
//! let pki = Pki::generate();
//! let (_server, url) = tls_redis(&pki, "no").await; // "yes": clients must present a certificate
//! println!("connect to {url}, trusting {}", pki.arg("ca.pem"));
//! # }
//! ```

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

use crate::{connect, RedisServer};

/// The ACL user [`tls_redis`] creates.
pub const USER: &str = "sg-tls";
/// Its password (tests check it never reaches an error message).
pub const PASSWORD: &str = "tls-s3cret";

/// Whether the `openssl` command is on PATH; prints a SKIPPED notice when it is not, for the
/// caller to return early.
pub fn have_openssl() -> bool {
    let found = Command::new("openssl").arg("version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !matches!(found, Ok(s) if s.success()) {
        eprintln!("SKIPPED: no `openssl` command on PATH to make the test certificates");
        return false;
    }
    true
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all signed
/// by the CA, in a directory of their own (removed on drop).
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// Makes the certificates, with the `openssl` command (see [`have_openssl`]).
    pub fn generate() -> Self {
        let dir = std::env::temp_dir().join(format!("sluicegate-tls-{}", crate::unique_namespace("pki")));
        std::fs::create_dir_all(&dir).unwrap();
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=sluicegate-test-ca",
            ],
        );
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        for (name, cn) in [("server", "localhost"), ("client", "sluicegate-client")] {
            let (key, csr, pem, ext) =
                (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"), format!("{name}.ext"));
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &key,
                    "-out",
                    &csr,
                    "-subj",
                    &format!("/CN={cn}"),
                ],
            );
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-extfile",
                    &ext,
                ],
            );
        }
        Self { dir }
    }

    /// The path of one of its files: `ca.pem`, `server.pem`, `server.key`, `client.pem`,
    /// `client.key`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// [`Pki::path`] as a string, for a command line.
    pub fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A redis-server with a TLS port beside its plain one (the harness waits for readiness on the
/// plain port, and the test sets up its ACL user there), and the rediss:// URL of the ACL user.
/// The TLS port is reserved as the harness reserves its own ports (`free_port`), and stays
/// reserved until the test process ends.
pub async fn tls_redis(pki: &Pki, auth_clients: &str) -> (RedisServer, String) {
    let tls_port = crate::free_port().expect("a free port");
    let server = RedisServer::builder()
        .extra_arg("tls-port", tls_port.to_string())
        .extra_arg("tls-cert-file", pki.arg("server.pem"))
        .extra_arg("tls-key-file", pki.arg("server.key"))
        .extra_arg("tls-ca-cert-file", pki.arg("ca.pem"))
        .extra_arg("tls-auth-clients", auth_clients)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = connect(&server.url()).await.unwrap();
    let acl = CustomCommand::new_static("ACL", ClusterHash::Random, false);
    let setuser: Vec<Value> = ["SETUSER", USER, "on", &format!(">{PASSWORD}"), "~*", "&*", "+@all"]
        .into_iter()
        .map(|a| Value::from(a.to_owned()))
        .collect();
    let _: Value = admin.custom(acl, setuser).await.unwrap();
    (server, format!("rediss://{USER}:{PASSWORD}@127.0.0.1:{tls_port}"))
}
