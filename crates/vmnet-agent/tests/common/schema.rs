//! A small checker for the subset of OpenAPI 3 / JSON Schema that `openapi.json` uses:
//! `$ref` to `#/components/schemas/*`, `type` (string, integer, number, boolean, array, object,
//! with `nullable`), `required`, `properties`, `items`, `enum`,
//! `minimum`/`maximum`, `additionalProperties` (false, or the schema of a map's values), `oneOf`, `allOf` (with `nullable`, the 3.0 idiom for a nullable `$ref`). Enough to validate every response the API tests see.

use serde_json::Value;

/// Validates `v` against `schema` (resolving refs in `doc`); returns every violation with its
/// JSON path.
pub fn validate(doc: &Value, schema: &Value, v: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    check(doc, schema, v, "$", &mut errs);
    errs
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let ptr = r.strip_prefix('#').expect("local $ref");
            resolve(
                doc,
                doc.pointer(ptr)
                    .unwrap_or_else(|| panic!("dangling $ref {r}")),
            )
        }
        None => schema,
    }
}

fn check(doc: &Value, schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    let schema = resolve(doc, schema);
    if v.is_null() {
        if schema.get("nullable").and_then(Value::as_bool) != Some(true) {
            errs.push(format!("{path}: null is not allowed"));
        }
        return;
    }
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        for a in all {
            check(doc, a, v, path, errs);
        }
        return;
    }
    if let Some(alts) = schema.get("oneOf").and_then(Value::as_array) {
        let ok = alts
            .iter()
            .filter(|a| validate(doc, a, v).is_empty())
            .count();
        if ok != 1 {
            errs.push(format!(
                "{path}: matches {ok} of the oneOf alternatives, not exactly one"
            ));
        }
        return;
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array)
        && !values.contains(v)
    {
        errs.push(format!("{path}: {v} is not one of {values:?}"));
    }
    let ty = schema.get("type").and_then(Value::as_str);
    let type_ok = match ty {
        None => true,
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some("array") => v.is_array(),
        Some("object") => v.is_object(),
        Some(other) => panic!("unsupported type {other} in the schema"),
    };
    if !type_ok {
        errs.push(format!("{path}: {v} is not of type {}", ty.unwrap_or("?")));
        return;
    }
    if let Some(n) = v.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            errs.push(format!("{path}: {n} < minimum {min}"));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            errs.push(format!("{path}: {n} > maximum {max}"));
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), v.as_array()) {
        for (i, item) in arr.iter().enumerate() {
            check(doc, items, item, &format!("{path}[{i}]"), errs);
        }
    }
    if let Some(obj) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        if let Some(req) = schema.get("required").and_then(Value::as_array) {
            for r in req.iter().filter_map(Value::as_str) {
                if !obj.contains_key(r) {
                    errs.push(format!("{path}: required property {r} is missing"));
                }
            }
        }
        let extra = schema.get("additionalProperties");
        let closed = extra == Some(&Value::Bool(false));
        for (k, val) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(s) => check(doc, s, val, &format!("{path}.{k}"), errs),
                None if closed => errs.push(format!("{path}: property {k} is not documented")),
                // A map: `additionalProperties` is the schema of every value.
                None => {
                    if let Some(s) = extra.filter(|e| e.is_object()) {
                        check(doc, s, val, &format!("{path}.{k}"), errs);
                    }
                }
            }
        }
    }
}
