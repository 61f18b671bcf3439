//! Reading the replies of the functions library (arrays of strings and bytes).

use bytes::Bytes;
use fred::types::Value;

use crate::error::{Error, Result};

/// The items of an array reply.
pub(crate) fn array(v: Value) -> Result<Vec<Value>> {
    match v {
        Value::Array(items) => Ok(items),
        Value::Null => Ok(Vec::new()),
        other => Err(Error::Protocol(format!("expected an array reply, got {other:?}"))),
    }
}

/// A reply item as text.
pub(crate) fn text(v: &Value) -> Result<String> {
    v.as_string().ok_or_else(|| Error::Protocol(format!("expected a string reply, got {v:?}")))
}

/// A reply item as bytes (payloads and results are binary).
pub(crate) fn bytes(v: Value) -> Result<Bytes> {
    match v {
        Value::Bytes(b) => Ok(b),
        Value::String(s) => Ok(s.into_inner()),
        Value::Null => Ok(Bytes::new()),
        other => Err(Error::Protocol(format!("expected a bulk reply, got {other:?}"))),
    }
}

/// A reply item as an integer (integers may arrive as strings).
pub(crate) fn int(v: &Value) -> Result<i64> {
    v.as_i64().ok_or_else(|| Error::Protocol(format!("expected an integer reply, got {v:?}")))
}
