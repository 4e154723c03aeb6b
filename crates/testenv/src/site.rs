//! A crawl target that refuses some of what it is sent, and the checks a crawl through the gateway must pass
//! against its log.
//!
//! [`LocalOrigin`](crate::LocalOrigin) serves it under `/site/`: `/site/` is an index linking [`SITE_PAGES`] pages
//! `/site/p/<n>`, and every [`REFUSE_EVERY`]th request from one address (8 %) is refused with `429` and
//! `Retry-After: 2` (the gateway cools that address down for the site for 2 s, and retries elsewhere). Every request
//! is logged with when it arrived, the address it came from, the path and the status, so a test judges the crawl
//! by what the site saw, not by what the crawler says.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The pages the index links to.
pub const SITE_PAGES: usize = 200;

/// One request in this many from an address is refused.
pub const REFUSE_EVERY: u64 = 12;

/// The refusal's `Retry-After`, in seconds.
pub const RETRY_AFTER_SECONDS: u64 = 2;

/// One request the site answered.
#[derive(Clone, Debug)]
pub struct Visit {
    /// When it arrived.
    pub at: Instant,
    /// The address it came from: the proxy's egress address.
    pub from: IpAddr,
    /// The path.
    pub path: String,
    /// 200 or 429.
    pub status: u16,
}

impl Visit {
    /// The page number of `/site/p/<n>`.
    pub fn page(&self) -> Option<usize> {
        self.path.strip_prefix("/site/p/")?.parse().ok()
    }
}

/// The site's counters and log.
#[derive(Default)]
pub struct CrawlSite {
    state: Mutex<SiteState>,
}

#[derive(Default)]
struct SiteState {
    per_address: HashMap<IpAddr, u64>,
    log: Vec<Visit>,
    /// Requests to the origin's `/logged` path, which refuses nothing: when each arrived and from where.
    arrivals: Vec<(Instant, IpAddr)>,
}

impl CrawlSite {
    /// Answers `path` (under `/site/`) for a request from `from`: the status line, extra headers and the body.
    pub(crate) fn answer(&self, path: &str, from: IpAddr) -> (&'static str, String, String) {
        let mut state = self.state.lock().expect("the site's state");
        let count = state.per_address.entry(from).or_default();
        *count += 1;
        let refuse = (*count).is_multiple_of(REFUSE_EVERY);
        let status = if refuse { 429 } else { 200 };
        state.log.push(Visit { at: Instant::now(), from, path: path.to_owned(), status });
        drop(state);
        if refuse {
            return (
                "429 Too Many Requests",
                format!("Retry-After: {RETRY_AFTER_SECONDS}\r\n"),
                "<html><body>slow down</body></html>".to_owned(),
            );
        }
        let body = if path == "/site/" {
            let links: String =
                (0..SITE_PAGES).map(|page| format!("<a href=\"/site/p/{page}\">{page}</a>\n")).collect();
            format!("<html><body>\n{links}</body></html>")
        } else {
            format!("<html><body>{path} seen from {from}</body></html>")
        };
        ("200 OK", "Cache-Control: no-store\r\n".to_owned(), body)
    }

    /// The requests to the origin's `/logged` path so far (which the site never refuses): when and from where.
    pub fn arrivals(&self) -> Vec<(Instant, IpAddr)> {
        self.state.lock().expect("the site's state").arrivals.clone()
    }

    /// Notes a request to `/logged` from `from`.
    pub(crate) fn arrive(&self, from: IpAddr) {
        self.state.lock().expect("the site's state").arrivals.push((Instant::now(), from));
    }

    /// Every request so far, in arrival order.
    pub fn log(&self) -> Vec<Visit> {
        self.state.lock().expect("the site's state").log.clone()
    }

    /// Forgets the log and the counts (for the next crawl).
    pub fn reset(&self) {
        *self.state.lock().expect("the site's state") = SiteState::default();
    }
}

/// Requests that arrived through an address cooling down for the site: from `grace` after a refusal of that address
/// until its `Retry-After` is over (less `grace`, for the crawler's clock).
pub fn through_cooling(log: &[Visit], grace: Duration) -> Vec<Visit> {
    let cooldown = Duration::from_secs(RETRY_AFTER_SECONDS);
    let refusals: Vec<&Visit> = log.iter().filter(|visit| visit.status == 429).collect();
    log.iter()
        .filter(|visit| {
            refusals.iter().any(|refusal| {
                refusal.from == visit.from && visit.at > refusal.at + grace && visit.at + grace < refusal.at + cooldown
            })
        })
        .cloned()
        .collect()
}

/// Moves of a session from one address to another that no refusal explains: a session's requests (pages `n` with
/// `n % sessions` its number, in arrival order) change address only after a refusal of the address they leave,
/// seen by the site between that session's last request there (less `grace`) and its first request elsewhere.
/// A refusal of any session moves every session of the tenant on that address, so it explains them all.
pub fn unexplained_moves(log: &[Visit], sessions: usize, grace: Duration) -> Vec<String> {
    let refusals: Vec<&Visit> = log.iter().filter(|visit| visit.status == 429).collect();
    let mut moves = Vec::new();
    for session in 0..sessions {
        let visits: Vec<&Visit> =
            log.iter().filter(|visit| visit.page().is_some_and(|page| page % sessions == session)).collect();
        for pair in visits.windows(2) {
            let (last, next) = (pair[0], pair[1]);
            if last.from == next.from {
                continue;
            }
            let explained = refusals
                .iter()
                .any(|refusal| refusal.from == last.from && refusal.at + grace >= last.at && refusal.at <= next.at);
            if !explained {
                moves.push(format!(
                    "session {session} moved from {} ({}) to {} ({}) {:?} later with no refusal of {} between",
                    last.from,
                    last.path,
                    next.from,
                    next.path,
                    next.at - last.at,
                    last.from
                ));
            }
        }
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visit(at: Instant, millis: u64, from: [u8; 4], page: usize, status: u16) -> Visit {
        Visit {
            at: at + Duration::from_millis(millis),
            from: IpAddr::from(from),
            path: format!("/site/p/{page}"),
            status,
        }
    }

    #[test]
    fn a_request_through_a_cooling_address_after_the_grace_is_counted_and_one_in_flight_is_not() {
        let start = Instant::now();
        let log = vec![
            visit(start, 0, [10, 0, 0, 1], 0, 429),
            visit(start, 50, [10, 0, 0, 1], 1, 200),
            visit(start, 500, [10, 0, 0, 1], 2, 200),
            visit(start, 600, [10, 0, 0, 2], 3, 200),
            visit(start, 2500, [10, 0, 0, 1], 4, 200),
        ];
        let cooling = through_cooling(&log, Duration::from_millis(100));
        assert_eq!(cooling.iter().map(|visit| visit.page()).collect::<Vec<_>>(), vec![Some(2)]);
    }

    #[test]
    fn a_move_is_explained_by_a_refusal_of_the_address_left_and_by_nothing_else() {
        let start = Instant::now();
        // Session 0 of 2: pages 0, 2, 4, 6.
        let log = vec![
            visit(start, 0, [10, 0, 0, 1], 0, 200),
            visit(start, 10, [10, 0, 0, 1], 1, 429),
            visit(start, 20, [10, 0, 0, 2], 2, 200),
            visit(start, 30, [10, 0, 0, 3], 4, 200),
        ];
        let moves = unexplained_moves(&log, 2, Duration::from_millis(100));
        assert_eq!(moves.len(), 1, "{moves:?}");
        assert!(moves[0].contains("from 10.0.0.2"), "{moves:?}");
    }

    #[test]
    fn every_twelfth_request_from_an_address_is_refused_with_a_retry_after() {
        let site = CrawlSite::default();
        let from = IpAddr::from([10, 0, 0, 1]);
        let statuses: Vec<&str> = (0..24).map(|_| site.answer("/site/p/1", from).0).collect();
        let refused: Vec<usize> =
            statuses.iter().enumerate().filter(|(_, status)| status.starts_with("429")).map(|(at, _)| at).collect();
        assert_eq!(refused, vec![11, 23]);
        assert!(site.answer("/site/", IpAddr::from([10, 0, 0, 2])).2.contains("href=\"/site/p/199\""));
        assert_eq!(site.log().len(), 25);
    }
}
