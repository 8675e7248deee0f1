//! A bandwidth limit shared by every request of one operation.

use std::time::Duration;

use tokio::time::Instant;

/// Paces transfers to at most `rate` bytes a second on average (bursts of one second).
#[derive(Debug)]
pub struct Pace {
    rate: Option<u64>,
    /// When the bytes already admitted will have been sent at `rate`.
    free_at: parking_lot::Mutex<Instant>,
}

impl Pace {
    pub fn new(rate: Option<u64>) -> Pace {
        Pace { rate: rate.filter(|&r| r > 0), free_at: parking_lot::Mutex::new(Instant::now()) }
    }

    /// Waits until `bytes` more may go.
    pub async fn admit(&self, bytes: u64) {
        let Some(rate) = self.rate else { return };
        let wait = {
            let mut free_at = self.free_at.lock();
            let now = Instant::now();
            // Unused time does not accumulate beyond a one-second burst.
            let start = (*free_at).max(now.checked_sub(Duration::from_secs(1)).unwrap_or(now));
            *free_at = start + Duration::from_secs_f64(bytes as f64 / rate as f64);
            start.saturating_duration_since(now)
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn holds_the_rate() {
        let pace = Pace::new(Some(10 << 20));
        let t = Instant::now();
        for _ in 0..10 {
            pace.admit(1 << 19).await;
        }
        // 5 MiB at 10 MiB/s: the first half MiB goes at once, the other nine wait 0.05 s each.
        let took = t.elapsed().as_secs_f64();
        assert!((0.44..0.8).contains(&took), "{took}");
        let none = Pace::new(None);
        let t = Instant::now();
        none.admit(u64::MAX).await;
        assert!(t.elapsed() < Duration::from_millis(1));
    }
}
