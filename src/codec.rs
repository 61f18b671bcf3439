//! Payload and result encoding: MessagePack (named fields, so other languages can read it).

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// Encodes a value as MessagePack with field names (maps, not arrays).
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(value).map_err(|e| Error::Codec(format!("cannot encode: {e}")))
}

/// Decodes MessagePack into `T`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        Error::Codec(format!("cannot decode {} bytes as {}: {e}", bytes.len(), std::any::type_name::<T>()))
    })
}

/// A part as a producer sends it: a value to encode, or bytes encoded already (a schedule's
/// stored parts).
pub(crate) trait Part {
    /// The part's MessagePack.
    fn into_part(self) -> Result<Vec<u8>>;
}

impl<T: Serialize> Part for T {
    fn into_part(self) -> Result<Vec<u8>> {
        encode(&self)
    }
}

/// A part encoded already, or still to encode: `Producer::submit_many` encodes a request's first
/// parts to tell whether a lane takes it, and hands the others to `submit` this way.
pub(crate) enum Pending<T> {
    Done(Vec<u8>),
    Todo(T),
}

impl<T: Serialize> Part for Pending<T> {
    fn into_part(self) -> Result<Vec<u8>> {
        match self {
            Pending::Done(bytes) => Ok(bytes),
            Pending::Todo(part) => encode(&part),
        }
    }
}

/// MessagePack encoded already: sent as it is.
#[cfg(feature = "schedules")]
#[derive(Clone, Debug)]
pub(crate) struct Encoded(pub(crate) Vec<u8>);

#[cfg(feature = "schedules")]
impl Part for Encoded {
    fn into_part(self) -> Result<Vec<u8>> {
        Ok(self.0)
    }
}
