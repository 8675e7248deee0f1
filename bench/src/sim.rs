//! A log-structured store reduced to its segment bookkeeping, to say what write amplification
//! a cleaner *should* reach on a given geometry and workload: client blocks go to a head
//! segment, and when free segments run below a mark the cleaner takes victims (greedy or
//! cost-benefit, [`Policy`]) and moves their live blocks — to cold heads of their own (one per
//! number of moves so far, up to `separate`) or, with none, to the client head. No batch
//! headers, no timing: the figure to hold the engine's against.

// Block numbers and slots index vectors of a simulated pool, far below 2^32.
#![allow(clippy::cast_possible_truncation)]

use std::collections::VecDeque;

/// Which blocks the client overwrites.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Traffic {
    /// Every block equally.
    Uniform,
    /// 80% of the writes to 20% of the blocks.
    Skewed,
    /// Zipf with exponent `s` over the blocks (rank order scattered over the volume).
    Zipf(f64),
}

impl std::str::FromStr for Traffic {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uniform" => Ok(Self::Uniform),
            "80/20" | "skewed" => Ok(Self::Skewed),
            "zipf" => Ok(Self::Zipf(0.99)),
            _ => Err(format!("unknown traffic {s:?} (uniform, 80/20, zipf)")),
        }
    }
}

impl std::fmt::Display for Traffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uniform => write!(f, "uniform"),
            Self::Skewed => write!(f, "80/20"),
            Self::Zipf(s) => write!(f, "zipf {s}"),
        }
    }
}

/// Draws block numbers of a volume of `blocks` blocks for a [`Traffic`].
#[derive(Debug)]
pub struct Picker {
    traffic: Traffic,
    blocks: u64,
    /// Zipf: cumulative weights of ranks 1..=blocks.
    cdf: Vec<f64>,
}

impl Picker {
    pub fn new(traffic: Traffic, blocks: u64) -> Self {
        let cdf = match traffic {
            Traffic::Zipf(s) => {
                let mut acc = 0.0;
                let mut v: Vec<f64> = (1..=blocks)
                    .map(|r| {
                        acc += 1.0 / (r as f64).powf(s);
                        acc
                    })
                    .collect();
                v.iter_mut().for_each(|x| *x /= acc);
                v
            }
            _ => Vec::new(),
        };
        Self { traffic, blocks, cdf }
    }

    /// The next block, from two random words.
    pub fn pick(&self, r1: u64, r2: u64) -> u64 {
        match self.traffic {
            Traffic::Uniform => r1 % self.blocks,
            Traffic::Skewed => {
                let hot = (self.blocks / 5).max(1);
                if r1 % 10 < 8 { r2 % hot } else { hot + r2 % (self.blocks - hot).max(1) }
            }
            Traffic::Zipf(_) => {
                let u = (r1 >> 11) as f64 / (1u64 << 53) as f64;
                let rank = self.cdf.partition_point(|&c| c < u) as u64;
                // Scatter ranks over the volume (an odd multiplier permutes a power-of-two
                // range; others just spread), so hot blocks are not all adjacent.
                rank.min(self.blocks - 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) % self.blocks
            }
        }
    }
}

/// How the cleaner picks its victim among sealed segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Fewest live blocks.
    Greedy,
    /// Highest `(1 - u) * age / (1 + u)` (Rosenblum & Ousterhout), age since last written.
    CostBenefit,
}

/// The geometry of a pool and when its cleaner runs.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub segments: usize,
    pub blocks_per_seg: usize,
    /// Blocks of the volume (all written before the measurement).
    pub volume_blocks: u64,
    /// Cleaning starts below this many free segments and stops at twice as many.
    pub low_water: usize,
}

/// What [`simulate`] measured over its last `measure` writes.
#[derive(Debug, Clone, Copy)]
pub struct SimResult {
    pub write_amplification: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Seg {
    Free,
    Open,
    Sealed,
}

struct Store {
    state: Vec<Seg>,
    live: Vec<u32>,
    /// Block number written at each slot of each segment.
    slots: Vec<Vec<u64>>,
    /// Where each block is: (segment, slot).
    at: Vec<(u32, u32)>,
    free: VecDeque<usize>,
    per: usize,
    media: u64,
    /// Client writes so far, and at each segment's last append (its age).
    clock: u64,
    stamp: Vec<u64>,
    /// How many times the blocks of each segment have been moved (the cold head it came from).
    class: Vec<usize>,
}

impl Store {
    fn open(&mut self) -> usize {
        let s = self.free.pop_front().expect("the simulation keeps free segments");
        self.state[s] = Seg::Open;
        self.class[s] = 0;
        self.slots[s].clear();
        s
    }

    /// Appends block `b` at `head` (a new segment once full).
    fn append(&mut self, head: &mut usize, b: u64) {
        if self.slots[*head].len() == self.per {
            self.state[*head] = Seg::Sealed;
            *head = self.open();
        }
        let (old_seg, _) = self.at[b as usize];
        if old_seg != u32::MAX {
            self.live[old_seg as usize] -= 1;
        }
        let slot = self.slots[*head].len();
        self.stamp[*head] = self.clock;
        self.slots[*head].push(b);
        self.live[*head] += 1;
        self.at[b as usize] = (u32::try_from(*head).expect("small"), u32::try_from(slot).expect("small"));
        self.media += 1;
    }

    fn release_empty(&mut self) {
        for s in 0..self.state.len() {
            if self.state[s] == Seg::Sealed && self.live[s] == 0 {
                self.state[s] = Seg::Free;
                self.free.push_back(s);
            }
        }
    }
}

/// Fills the volume sequentially, writes `warmup` blocks of `traffic`, then `measure` more, and
/// returns the write amplification over the latter.
pub fn simulate(
    g: Geometry,
    traffic: Traffic,
    policy: Policy,
    separate: usize,
    warmup: u64,
    measure: u64,
    seed: u64,
) -> SimResult {
    let picker = Picker::new(traffic, g.volume_blocks);
    let mut st = Store {
        state: vec![Seg::Free; g.segments],
        live: vec![0; g.segments],
        slots: vec![Vec::with_capacity(g.blocks_per_seg); g.segments],
        at: vec![(u32::MAX, 0); usize::try_from(g.volume_blocks).expect("fits")],
        free: (0..g.segments).collect(),
        per: g.blocks_per_seg,
        media: 0,
        clock: 0,
        stamp: vec![0; g.segments],
        class: vec![0; g.segments],
    };
    let mut hot = st.open();
    let mut cold: Vec<usize> = (0..separate).map(|_| st.open()).collect();
    for (i, &c) in cold.iter().enumerate() {
        st.class[c] = i + 1;
    }
    for b in 0..g.volume_blocks {
        st.append(&mut hot, b);
    }
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut client, mut media0) = (0u64, 0u64);
    for i in 0..warmup + measure {
        if i == warmup {
            client = 0;
            media0 = st.media;
        }
        let b = picker.pick(next(), next());
        st.clock += 1;
        st.append(&mut hot, b);
        client += 1;
        if st.free.len() < g.low_water {
            while st.free.len() < 2 * g.low_water {
                let per = g.blocks_per_seg as f64;
                let score = |s: usize| {
                    let u = f64::from(st.live[s]) / per;
                    match policy {
                        Policy::Greedy => 1.0 - u,
                        Policy::CostBenefit => (1.0 - u) * (st.clock - st.stamp[s]) as f64 / (1.0 + u),
                    }
                };
                let victim = (0..g.segments)
                    .filter(|&s| st.state[s] == Seg::Sealed && (st.live[s] as usize) < g.blocks_per_seg)
                    .max_by(|&a, &b| score(a).total_cmp(&score(b)));
                let Some(v) = victim else { break };
                let blocks: Vec<u64> = st.slots[v]
                    .iter()
                    .enumerate()
                    .filter(|&(slot, &b)| st.at[b as usize] == (v as u32, slot as u32))
                    .map(|(_, &b)| b)
                    .collect();
                // Moved blocks go one class up: to the cold head after the victim's own.
                let class = st.class[v].min(cold.len().saturating_sub(1));
                for b in blocks {
                    match cold.get_mut(class) {
                        Some(c) => {
                            let before = *c;
                            st.append(c, b);
                            if *c != before {
                                st.class[*c] = class + 1;
                            }
                        }
                        None => st.append(&mut hot, b),
                    }
                }
                st.release_empty();
            }
        }
    }
    SimResult { write_amplification: (st.media - media0) as f64 / client.max(1) as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(fill: u64) -> Geometry {
        Geometry { segments: 200, blocks_per_seg: 512, volume_blocks: 200 * 512 * fill / 100, low_water: 4 }
    }

    #[test]
    fn amplification_grows_with_fill_and_separation_helps_skewed_traffic() {
        let wa = |fill, t, p, sep| simulate(geom(fill), t, p, sep, 400_000, 400_000, 7).write_amplification;
        let (u70, u90) = (wa(70, Traffic::Uniform, Policy::Greedy, 1), wa(90, Traffic::Uniform, Policy::Greedy, 1));
        assert!(u70 > 1.2 && u90 > u70 + 1.0, "uniform 70% {u70:.2}, 90% {u90:.2}");
        let (mixed, sep) =
            (wa(80, Traffic::Skewed, Policy::Greedy, 0), wa(80, Traffic::Skewed, Policy::CostBenefit, 3));
        assert!(sep < mixed * 0.92, "80/20: greedy mixed {mixed:.2}, cost-benefit separated {sep:.2}");
    }

    #[test]
    fn skewed_pickers_are_skewed() {
        let n = 10_000;
        for t in [Traffic::Skewed, Traffic::Zipf(0.99)] {
            let p = Picker::new(t, n);
            let mut x = 99u64;
            let mut hits = vec![0u32; n as usize];
            for _ in 0..100_000 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let r1 = x;
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                hits[p.pick(r1, x) as usize] += 1;
            }
            hits.sort_unstable_by(|a, b| b.cmp(a));
            let top: u32 = hits[..(n / 5) as usize].iter().sum();
            assert!(top > 70_000, "{t}: the busiest 20% took {top} of 100000");
        }
    }
}
