//! A VM's document with its `GET` answers serialised once, when the document is set
//! ([`Document::new`]), so that a request is a lookup and a [`Bytes`] clone instead of a
//! `serde_json` serialisation (issue 15: the guest agent reads `/latest/meta-data` as JSON
//! every 250 ms, a thousand VMs at once).
//!
//! - Kept: the folders (objects), the answers worth keeping (a folder's JSON is most of the
//!   document, its listing a walk of its keys); a leaf's answer is a copy of a short value and
//!   is made per request as before.
//! - The whole document is serialised once (compact JSON, exactly as `serde_json` writes it);
//!   the JSON answer of every folder is a slice of that one buffer (a node's compact JSON is a
//!   substring of its parent's), and the listings are slices of a second buffer: per VM two
//!   buffers and a sorted table, not an allocation per answer.
//! - Folders are found by the path a sanitised request names them with (keys JSON-pointer
//!   escaped: `~0`, `~1`; one under an empty key is never a sanitised path and is left out, as
//!   is everything in an array). Anything not kept (a leaf, an array, a non-canonical escape,
//!   an unknown path) falls back to [`super::mmds`]'s lookup in the document itself, so every
//!   answer is byte for byte the one that lookup gives.

use std::ops::Range;

use hyper::body::Bytes;
use hyper::header::HeaderMap;
use serde_json::Value;

use super::mmds::{self, MmdsResponse};

/// One folder's answers.
#[derive(Debug)]
struct Answer {
    json: Bytes,
    text: Bytes,
}

/// A VM's document and its pre-serialised answers.
#[derive(Debug)]
pub struct Document {
    value: Value,
    /// By path, sorted.
    answers: Vec<(Box<str>, Answer)>,
}

impl Document {
    /// Serialises every answer of `value` (see the module docs).
    #[must_use]
    pub fn new(value: Value) -> Self {
        let mut out = Vec::new();
        let mut texts = Vec::new();
        let mut spans = Vec::new();
        write(&value, Some("/"), &mut out, &mut texts, &mut spans);
        let (out, texts) = (Bytes::from(out), Bytes::from(texts));
        let mut answers: Vec<(Box<str>, Answer)> = spans
            .into_iter()
            .map(|s| {
                let a = Answer {
                    json: out.slice(s.json),
                    text: texts.slice(s.text),
                };
                (s.path.into_boxed_str(), a)
            })
            .collect();
        answers.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Self { value, answers }
    }

    /// The document.
    #[must_use]
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// How many folders have pre-serialised answers.
    #[must_use]
    pub fn cached(&self) -> usize {
        self.answers.len()
    }

    /// The answer to an authorised `GET path` (the same as [`mmds::get`] on the document).
    pub(super) fn get(&self, path: &str, headers: &HeaderMap) -> MmdsResponse {
        let hit = if is_sanitized(path) {
            self.find(path)
        } else {
            self.find(&mmds::sanitize(path))
        };
        let Some(a) = hit else {
            return mmds::get(&self.value, path, headers);
        };
        if mmds::wants_json(headers) {
            mmds::json(a.json.clone())
        } else {
            mmds::text(hyper::StatusCode::OK, a.text.clone())
        }
    }

    fn find(&self, path: &str) -> Option<&Answer> {
        self.answers
            .binary_search_by(|(p, _)| (**p).cmp(path))
            .ok()
            .map(|i| &self.answers[i].1)
    }
}

/// Whether [`mmds::sanitize`] leaves `path` as it is (no `//`, no trailing `/` but the root's).
fn is_sanitized(path: &str) -> bool {
    !path.contains("//") && (path.len() <= 1 || !path.ends_with('/'))
}

/// A key as a JSON-pointer token (RFC 6901: `~` as `~0`, `/` as `~1`).
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// Where a folder's answers are in the two buffers.
struct Span {
    path: String,
    json: Range<usize>,
    text: Range<usize>,
}

/// Writes `v` as compact JSON to `out`, and for every folder reached through object keys whose
/// `path` a sanitised request can name (`None`: not nameable) its listing to `texts` and where
/// both are to `spans`.
fn write(
    v: &Value,
    path: Option<&str>,
    out: &mut Vec<u8>,
    texts: &mut Vec<u8>,
    spans: &mut Vec<Span>,
) {
    let start = out.len();
    if let Value::Object(m) = v {
        out.push(b'{');
        for (i, (k, child)) in m.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            // Writing to a Vec fails only on a key serde_json cannot write, which a String is not.
            let _ = serde_json::to_writer(&mut *out, k);
            out.push(b':');
            let child_path = path.filter(|_| !k.is_empty()).map(|p| {
                let base = if p == "/" { "" } else { p };
                format!("{base}/{}", escape(k))
            });
            write(child, child_path.as_deref(), out, texts, spans);
        }
        out.push(b'}');
        if let Some(p) = path {
            let listed = texts.len();
            texts.extend_from_slice(mmds::imds(v).unwrap_or_default().as_bytes());
            spans.push(Span {
                path: p.to_owned(),
                json: start..out.len(),
                text: listed..texts.len(),
            });
        }
    } else {
        let _ = serde_json::to_writer(&mut *out, v);
    }
}

#[cfg(test)]
#[path = "answers_tests.rs"]
mod tests;
