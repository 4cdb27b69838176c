//! `GET /v1/events`: the agent's events as NDJSON (see [`crate::events::stream`]).

use std::sync::Arc;

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::agent::Agent;
use crate::events::stream::{ConnCut, Filter, NDJSON, body};

/// `GET /v1/events[?vm=ID][&kind=K][&follow=true|false][&since=SEQ][&run=ID]`: the kept events,
/// and with `follow=true` every new one, one JSON object per line; a position of another run
/// of the agent, or one whose events are no longer kept, is `CONFLICT`.
pub async fn events(
    State(a): State<Arc<Agent>>,
    RawQuery(q): RawQuery,
    cut: Option<Extension<ConnCut>>,
) -> Result<Response, ApiError> {
    let filter = Filter::parse(q.as_deref())?;
    let follow = filter.follow;
    let body = body(a.events(), filter, cut.map(|Extension(c)| c))?;
    let mut resp = (
        [
            (header::CONTENT_TYPE, NDJSON),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response();
    if follow {
        resp.headers_mut().insert(
            header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    Ok(resp)
}
