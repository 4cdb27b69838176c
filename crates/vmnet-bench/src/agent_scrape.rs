//! The scrape part of `vmnet-lab bench agent`: at the last checkpoint (1000 VMs by default),
//! how long `GET /metrics` over the API socket takes, and whether scraping moves the PUT
//! median. It scrapes [`SCRAPES`] times one after another (time per scrape: median, p99, and
//! the body's size), then PUTs 2 × [`PUTS`] new VMs in blocks of [`BLOCK`] that alternate
//! between no scrapes and a task scraping every [`SCRAPE_EVERY`] (40× more often than
//! Prometheus' default of 15 s), and DELETEs those VMs again. Same agent, same run; the
//! alternation spreads both groups over the same stretch of time and VM counts, so a drift of
//! the host's load or of the VM count does not land on one group only.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::Value;
use vmnet_agent::api::types::VmView;
use vmnet_agent::client::Client;
use vmnet_model::Error;

use crate::vms::{Stats, stats};

/// Scrapes timed one after another.
pub const SCRAPES: usize = 50;

/// PUTs per group.
pub const PUTS: u32 = 100;

/// PUTs per block; the blocks alternate between the groups, the first without scrapes.
pub const BLOCK: u32 = 20;

/// How often the concurrent scraper scrapes.
pub const SCRAPE_EVERY: Duration = Duration::from_millis(375);

/// What the scrape measurement found.
#[derive(Debug, Clone)]
pub struct ScrapeReport {
    /// VMs in the store while scraping.
    pub vms: u32,
    /// Time per scrape.
    pub scrape: Stats,
    /// The body's size, bytes.
    pub bytes: usize,
    /// PUT latency without scrapes.
    pub puts_alone: Stats,
    /// PUT latency with the scraper running.
    pub puts_scraped: Stats,
    /// Scrapes made while the blocks with scrapes ran.
    pub concurrent_scrapes: u64,
}

async fn scrape(client: &Client) -> Result<(Duration, usize), Error> {
    let t = Instant::now();
    let (status, body) = client.send_raw(Method::GET, "/metrics", None).await?;
    if !status.is_success() {
        return Err(Error::internal(format!("GET /metrics answered {status}")));
    }
    Ok((t.elapsed(), body.len()))
}

async fn put_group(
    client: &Client,
    uids: std::ops::RangeInclusive<u32>,
    body: &dyn Fn(u32) -> Value,
) -> Result<Vec<Duration>, Error> {
    let mut out = Vec::new();
    for uid in uids {
        let t = Instant::now();
        let _: VmView = client
            .put(&format!("/v1/vms/bench-{uid}"), &body(uid))
            .await?;
        out.push(t.elapsed());
    }
    Ok(out)
}

/// Runs the measurement with `vms` VMs stored (user ids 1..=vms); adds and removes user ids
/// `vms + 1 ..= vms + 2·PUTS`.
///
/// # Errors
/// When a scrape, a PUT or a DELETE fails.
pub async fn measure(
    client: &Client,
    vms: u32,
    body: &dyn Fn(u32) -> Value,
) -> Result<ScrapeReport, Error> {
    let mut times = Vec::with_capacity(SCRAPES);
    let mut bytes = 0;
    for _ in 0..SCRAPES {
        let (t, n) = scrape(client).await?;
        times.push(t);
        bytes = n;
    }
    let made = Arc::new(AtomicU64::new(0));
    let (on, mut on_rx) = tokio::sync::watch::channel(false);
    let scraper = {
        let client = Client::new(client.socket());
        let made = Arc::clone(&made);
        tokio::spawn(async move {
            loop {
                if on_rx.wait_for(|on| *on).await.is_err() {
                    return;
                }
                if scrape(&client).await.is_ok() {
                    made.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(SCRAPE_EVERY).await;
            }
        })
    };
    let (mut alone, mut scraped) = (Vec::new(), Vec::new());
    let mut outcome = Ok(());
    for (i, first) in (vms + 1..=vms + 2 * PUTS)
        .step_by(BLOCK as usize)
        .enumerate()
    {
        let with = i % 2 == 1;
        on.send_replace(with);
        let last = (first + BLOCK - 1).min(vms + 2 * PUTS);
        match put_group(client, first..=last, body).await {
            Ok(t) if with => scraped.extend(t),
            Ok(t) => alone.extend(t),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    scraper.abort();
    outcome?;
    for uid in vms + 1..=vms + 2 * PUTS {
        let _: VmView = client.delete(&format!("/v1/vms/bench-{uid}")).await?;
    }
    Ok(ScrapeReport {
        vms,
        scrape: stats(&times),
        bytes,
        puts_alone: stats(&alone),
        puts_scraped: stats(&scraped),
        concurrent_scrapes: made.load(Ordering::Relaxed),
    })
}

/// The report's lines.
#[must_use]
pub fn render(r: &ScrapeReport) -> String {
    format!(
        "GET /metrics at {} VMs: median {:.1} ms, p99 {:.1} ms, {} KiB (target ≤ 50 ms)\n\
         PUT median without scrapes {:.2} ms (p99 {:.2}), with a scrape every {} ms {:.2} ms (p99 {:.2}; {} PUTs each, in alternating blocks of {}; {} scrapes ran)\n",
        r.vms,
        r.scrape.median,
        r.scrape.p99,
        r.bytes / 1024,
        r.puts_alone.median,
        r.puts_alone.p99,
        SCRAPE_EVERY.as_millis(),
        r.puts_scraped.median,
        r.puts_scraped.p99,
        PUTS,
        BLOCK,
        r.concurrent_scrapes
    )
}
