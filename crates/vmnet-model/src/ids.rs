//! Object ids: the one rule every pool, host, instance and allocation id follows. A leaf module:
//! the pool ranges, instances and NICs build on it.

use crate::ValidationError;

/// The longest id accepted for pools, hosts and instances, in bytes.
pub const MAX_ID_LEN: usize = 64;

/// Checks an object id: 1 to [`MAX_ID_LEN`] bytes of `[A-Za-z0-9._-]`, starting with a letter or
/// digit. `field` names the field in the error (e.g. `instance_id`).
///
/// # Errors
/// `INVALID_INPUT` naming `field`: `instance_id must not be empty`,
/// `instance_id is 70 bytes long; at most 64 are allowed`,
/// `instance_id "a;b" may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit`.
pub fn validate_id(field: &str, value: &str) -> Result<(), ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::rule(format!("{field} must not be empty")));
    }
    if value.len() > MAX_ID_LEN {
        return Err(ValidationError::rule(format!(
            "{field} is {} bytes long; at most {MAX_ID_LEN} are allowed",
            value.len()
        )));
    }
    let ok_start = value.as_bytes()[0].is_ascii_alphanumeric();
    let ok_chars = value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !ok_start || !ok_chars {
        return Err(ValidationError::rule(format!(
            "{field} {value:?} may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(validate_id("instance_id", "vm-1.a_b").is_ok());
        assert_eq!(
            validate_id("instance_id", "").unwrap_err().to_string(),
            "instance_id must not be empty"
        );
        assert!(validate_id("instance_id", "-x").is_err());
        assert!(validate_id("instance_id", "a'; DROP TABLE x; --").is_err());
        assert!(validate_id("instance_id", &"a".repeat(65)).is_err());
        assert!(validate_id("instance_id", &"a".repeat(64)).is_ok());
    }
}
