//! What encryption at rest costs per byte: AES-256-XTS (the `aes` crate, AES-NI where the CPU
//! has it) encrypting and decrypting 4 KiB and 128 KiB, side by side with crc32c over the same
//! bytes, which the engine already computes for every block it writes and reads. The ratio to
//! crc32c is the figure to compare across machines; 1 / throughput is the CPU time per GiB.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferrite_crypt::DataKey;

fn bench(c: &mut Criterion) {
    let key = DataKey::generate().expect("system RNG");
    let mut g = c.benchmark_group("crypt");
    for size in [4usize << 10, 128 << 10] {
        let mut buf: Vec<u8> = (0..size).map(|i| u8::try_from(i % 251).unwrap()).collect();
        g.throughput(Throughput::Bytes(size as u64));
        let kib = size >> 10;
        g.bench_function(format!("xts-encrypt-{kib}k"), |b| b.iter(|| key.encrypt(7, &mut buf)));
        g.bench_function(format!("xts-decrypt-{kib}k"), |b| b.iter(|| key.decrypt(7, &mut buf)));
        g.bench_function(format!("crc32c-{kib}k"), |b| b.iter(|| crc32c::crc32c(&buf)));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
