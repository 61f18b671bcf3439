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
