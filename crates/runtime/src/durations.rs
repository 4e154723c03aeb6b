//! Durations on the command line: `90s`, `5m`, `1h30m`, `250ms`, as Go writes them, and `0`.

use std::time::Duration;

/// Parses `90s`, `5m`, `1h30m`, `250ms` (Go-style durations) and `0`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    if rest.is_empty() {
        return Err("is empty".into());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{text:?} is not a duration such as 90s, 5m or 1h30m"));
        }
        let number: u64 = rest[..digits].parse().map_err(|_| format!("{text:?} has a number out of range"))?;
        rest = &rest[digits..];
        let (unit, after) = ["ms", "s", "m", "h"]
            .iter()
            .find_map(|unit| rest.strip_prefix(unit).map(|after| (*unit, after)))
            .ok_or_else(|| format!("{text:?} is not a duration such as 90s, 5m or 1h30m (units: ms, s, m, h)"))?;
        total += match unit {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.saturating_mul(60)),
            _ => Duration::from_secs(number.saturating_mul(3600)),
        };
        rest = after;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_like_go() {
        let cases = [("90s", 90), ("5m", 300), ("1h30m", 5400), ("0", 0), ("2h", 7200)];
        for (text, seconds) in cases {
            assert_eq!(parse_duration(text), Ok(Duration::from_secs(seconds)), "{text}");
        }
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["", "5", "m", "5x", "-5m", "1.5h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
