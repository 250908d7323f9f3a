use std::time::Instant;
fn main() {
    let size: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(65000);
    let iters = (4usize << 30) / size;
    let key = [7u8; 16];
    let mut buf = vec![1u8; size];
    {
        use ring::aead::*;
        let k = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &key).unwrap());
        let t = Instant::now();
        for i in 0..iters {
            let mut n = [0u8; 12]; n[4..].copy_from_slice(&(i as u64).to_be_bytes());
            let tag = k.seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(&[0u8; 20]), &mut buf).unwrap();
            std::hint::black_box(tag);
        }
        let s = t.elapsed().as_secs_f64();
        println!("ring seal   {:.3} ns/B {:.2} GB/s", s * 1e9 / (iters * size) as f64, (iters * size) as f64 / s / 1e9);
        let t = Instant::now();
        for i in 0..iters {
            let mut n = [0u8; 12]; n[4..].copy_from_slice(&(i as u64).to_be_bytes());
            // open without tag check cost measured via seal of same size (open_in_place needs valid tag)
            let r = k.open_in_place(Nonce::assume_unique_for_key(n), Aad::from(&[0u8; 20]), &mut buf[..]);
            std::hint::black_box(r.is_err());
        }
        let s = t.elapsed().as_secs_f64();
        println!("ring open   {:.3} ns/B (fails tag)", s * 1e9 / (iters * size) as f64);
    }
    {
        use aws_lc_rs::aead::*;
        let k = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &key).unwrap());
        let t = Instant::now();
        for i in 0..iters {
            let mut n = [0u8; 12]; n[4..].copy_from_slice(&(i as u64).to_be_bytes());
            let tag = k.seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(&[0u8; 20]), &mut buf).unwrap();
            std::hint::black_box(tag);
        }
        let s = t.elapsed().as_secs_f64();
        println!("awslc seal  {:.3} ns/B {:.2} GB/s", s * 1e9 / (iters * size) as f64, (iters * size) as f64 / s / 1e9);
        let t = Instant::now();
        for i in 0..iters {
            let mut n = [0u8; 12]; n[4..].copy_from_slice(&(i as u64).to_be_bytes());
            let r = k.open_in_place(Nonce::assume_unique_for_key(n), Aad::from(&[0u8; 20]), &mut buf[..]);
            std::hint::black_box(r.is_err());
        }
        let s = t.elapsed().as_secs_f64();
        println!("awslc open  {:.3} ns/B (fails tag)", s * 1e9 / (iters * size) as f64);
    }
}
