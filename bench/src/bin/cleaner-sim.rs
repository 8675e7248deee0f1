//! Write amplification a cleaner reaches in simulation (`ferrite_bench::sim`), for uniform,
//! 80/20 and Zipf traffic at 70/80/90% full: greedy and cost-benefit victims, with the moved
//! blocks mixed with client writes, on one cold head, or on three (by times moved). The figures
//! the engine's `cleaner-load` is held against, and what the choices in the cleaner rest on.
//!
//! Usage: cleaner-sim [segments=512] [blocks-per-segment=1024]

use ferrite_bench::sim::{Geometry, Policy, Traffic, simulate};

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|v| v.parse().ok()).unwrap_or(d);
    let (segments, per) = (arg(1, 512), arg(2, 1024));
    println!("{segments} segments of {per} blocks; write amplification after 4 pool turns, over 4 more");
    println!("{:<14} {:>22} {:>29}", "", "greedy", "cost-benefit");
    println!(
        "{:<14} {:>7}{:>7}{:>8} {:>9}{:>7}{:>8}",
        "fill traffic", "mixed", "1 cold", "3 cold", "mixed", "1 cold", "3 cold"
    );
    for fill in [70u64, 80, 90] {
        for traffic in [Traffic::Uniform, Traffic::Skewed, Traffic::Zipf(0.99)] {
            let volume_blocks = (segments * per) as u64 * fill / 100;
            let g = Geometry { segments, blocks_per_seg: per, volume_blocks, low_water: 4 };
            let turns = 4 * (segments * per) as u64;
            let wa = |p, sep| simulate(g, traffic, p, sep, turns, turns, 7).write_amplification;
            println!(
                "{:<14} {:>7.2}{:>7.2}{:>8.2} {:>9.2}{:>7.2}{:>8.2}",
                format!("{fill}% {traffic}"),
                wa(Policy::Greedy, 0),
                wa(Policy::Greedy, 1),
                wa(Policy::Greedy, 3),
                wa(Policy::CostBenefit, 0),
                wa(Policy::CostBenefit, 1),
                wa(Policy::CostBenefit, 3),
            );
        }
    }
}
