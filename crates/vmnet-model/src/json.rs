//! JSON documents read into a [`serde_json::Value`] without losing a repeated key.
//!
//! `serde_json` keeps the last of two equal keys in an object, so `{"tenant": 1, "tenant": 2}`
//! would be read as tenant 2 with no word to the user. Documents that are validated from a
//! `Value` (a VM config, a host spec) are read through [`from_slice`] instead, which refuses a
//! repeated key with the parser's line and column, like any other malformed JSON.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses `bytes` as one JSON value, refusing any object that repeats a key.
///
/// # Errors
/// The parser's error for malformed JSON, or `duplicate key "k"` (with line and column) for an
/// object that holds the key `k` twice, at any depth.
pub fn from_slice(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    serde_json::from_slice::<Strict>(bytes).map(|s| s.0)
}

/// A [`Value`] whose objects are checked for repeated keys while they are read.
struct Strict(Value);

impl<'de> de::Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key {key:?}")));
            }
            let Strict(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_serde_json_reads() {
        let text = br#"{"a": [1, -2, 2.5, "x", null, true, {"b": {}}], "c": 18446744073709551615}"#;
        let strict = from_slice(text).unwrap();
        let plain: Value = serde_json::from_slice(text).unwrap();
        assert_eq!(strict, plain);
    }

    #[test]
    fn refuses_a_repeated_key_at_any_depth_with_its_position() {
        let e = from_slice(br#"{"id": "a", "tenant": 1, "tenant": 2}"#).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("duplicate key \"tenant\" at line 1"),
            "{e}"
        );
        let e = from_slice(br#"{"x": [{"k": 1, "k": 1}]}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key \"k\""), "{e}");
        assert!(
            from_slice(br#"{"k": {"k": 1}}"#).is_ok(),
            "same key at two levels is fine"
        );
    }
}
