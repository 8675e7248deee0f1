//! How client commands print: a table or JSON, and progress on stderr.

use anyhow::Result;
use ferrite_daemon::base::size::format_size;
use serde_json::json;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// Turns a gRPC status into a one-line error.
pub fn rpc_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", s.message())
}

pub fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ").trim_end().to_string()
    };
    let mut out = vec![line(headers.iter().map(|h| (*h).to_string()).collect())];
    out.extend(rows.into_iter().map(line));
    out.join("\n")
}

/// Seconds since the epoch as `YYYY-MM-DD hh:mm:ss` (UTC).
pub fn format_time(unix: u64) -> String {
    let Ok(t) =
        i64::try_from(unix).map_err(drop).and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).map_err(drop))
    else {
        return unix.to_string();
    };
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// One line (or a JSON object) saying what was done to what.
pub fn print_done(out: Output, what: &str, name: &str) {
    match out {
        Output::Json => println!("{}", json!({ what.split(' ').next().unwrap_or(what): name })),
        Output::Table => println!("{what} {name}"),
    }
}

/// Follows a streamed job to its end: a progress line (table output) fed by `progress` of each
/// message, which also says whether the message is the final one; returns that final message.
pub async fn follow<T>(
    mut stream: tonic::Streaming<T>,
    what: &'static str,
    out: Output,
    progress: impl Fn(&T) -> (u64, u64, bool),
) -> Result<T> {
    let mut last = None;
    let mut bar = (out == Output::Table).then(|| Progress::new(what));
    while let Some(m) = stream.message().await.map_err(rpc_error)? {
        let (done, total, finished) = progress(&m);
        if let Some(bar) = &mut bar {
            bar.update(done, total);
        }
        if finished {
            last = Some(m);
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    last.ok_or_else(|| anyhow::anyhow!("the daemon ended the {what} without a result"))
}

/// Progress of a long operation on stderr: an indicatif bar on a terminal, left at its final
/// state when done; elsewhere (logs, CI), where indicatif draws nothing, a line at every 25%.
#[derive(Debug)]
pub struct Progress {
    what: &'static str,
    bar: Option<indicatif::ProgressBar>,
    quarter: Option<u64>,
}

impl Progress {
    pub fn new(what: &'static str) -> Self {
        let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
            let style = indicatif::ProgressStyle::with_template(
                "{prefix}: [{bar:25}] {percent:>3}% {binary_bytes} of {binary_total_bytes} ({binary_bytes_per_sec}, {eta} left)",
            )
            .expect("a valid template")
            .progress_chars("#>-");
            indicatif::ProgressBar::new(0).with_style(style).with_prefix(what)
        });
        Self { what, bar, quarter: None }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(total);
                bar.set_position(done);
            }
            None => {
                let pct = (done * 100).checked_div(total).unwrap_or(100);
                if self.quarter.replace(pct / 25) != Some(pct / 25) {
                    eprintln!("{}: {pct}% ({} of {})", self.what, format_size(done), format_size(total));
                }
            }
        }
    }

    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish();
            eprintln!(); // indicatif leaves the cursor on the bar's line
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc_and_zero_padded() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_time(1_795_000_000), "2026-11-18 11:06:40");
        assert_eq!(format_time(u64::MAX), u64::MAX.to_string(), "out of range: the raw number");
    }
}
