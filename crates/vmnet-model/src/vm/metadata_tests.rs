use super::metadata::{MetadataConfig, MetadataVersion};
use super::parse_vm_config;

fn parse(extra: &str) -> Result<super::VmConfig, String> {
    let doc = format!(r#"{{"id":"vm-7","user_id":7,"tenant":1{extra}}}"#);
    parse_vm_config(doc.as_bytes()).map_err(|e| e.message())
}

#[test]
fn absent_or_null_is_the_host_default() {
    assert_eq!(parse("").unwrap().metadata, None);
    assert_eq!(parse(r#","metadata":null"#).unwrap().metadata, None);
    assert_eq!(
        parse(r#","metadata":{}"#).unwrap().metadata,
        Some(MetadataConfig { version: None })
    );
}

#[test]
fn versions_parse_and_round_trip() {
    for (text, v) in [("v1", MetadataVersion::V1), ("v2", MetadataVersion::V2)] {
        let cfg = parse(&format!(r#","metadata":{{"version":"{text}"}}"#)).unwrap();
        assert_eq!(cfg.metadata, Some(MetadataConfig { version: Some(v) }));
        let json = serde_json::to_string(&cfg).unwrap();
        assert!(
            json.contains(&format!(r#""metadata":{{"version":"{text}"}}"#)),
            "{json}"
        );
        assert_eq!(parse_vm_config(json.as_bytes()).unwrap(), cfg);
    }
}

#[test]
fn bad_values_name_the_field() {
    assert_eq!(
        parse(r#","metadata":{"version":"v3"}"#).unwrap_err(),
        r#"vm vm-7: metadata.version "v3" is not a metadata version; use "v1" or "v2""#
    );
    assert_eq!(
        parse(r#","metadata":{"version":2}"#).unwrap_err(),
        r#"vm vm-7: metadata.version must be "v1" or "v2", got 2"#
    );
    assert_eq!(
        parse(r#","metadata":{"ttl":5}"#).unwrap_err(),
        "vm vm-7: metadata.ttl is an unknown field"
    );
    assert_eq!(
        parse(r#","metadata":"v2""#).unwrap_err(),
        r#"vm vm-7: metadata must be an object, got "v2""#
    );
}
