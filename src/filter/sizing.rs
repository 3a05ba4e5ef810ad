//! Sizing: the classic Bloom formulas and the exact false-positive model of
//! the cache-line-blocked layout used to size it.
//!
//! # Why the classic formulas are not enough
//! `optimal_num_bits` / `optimal_num_hashes` assume every key spreads its k
//! bits over the whole array. The blocked layout confines them to one 512-bit
//! block, and blocks receive unequal numbers of keys (≈ Poisson(n/blocks)):
//! overloaded blocks produce more false positives than underloaded ones save,
//! so a blocked filter with the classic size misses its target (≈1.2 % instead
//! of 1 % at 9.6 bits/key).
//!
//! # The model ([`blocked_fp_rate`])
//! Positions are modelled as independent uniform draws (with replacement) in
//! the block, which is what `bloom.rs` produces. For a query, let J be the
//! number of keys in its block (J ~ Binomial(n, 1/B)) and D the number of
//! distinct positions among its k draws. Given J = j and D = d, the query is a
//! false positive iff all d positions are among the bits set by the kj stored
//! draws; by inclusion–exclusion
//!
//! ```text
//! P(FP | j, d) = Σ_{i=0..d} (-1)^i C(d,i) (1 - i/512)^(k·j)
//! P(D = d)     = S2(k,d) · 512·511·…·(512-d+1) / 512^k      (Stirling 2nd kind)
//! ```
//!
//! and averaging over J uses the binomial probability generating function
//! `E[x^J] = (1 - (1-x)/B)^n`, which gives a closed form with O(k²) terms.
//!
//! The formula usually quoted for blocked filters,
//! `Σ_j Pois(j; n/B) · (1 - (1-1/512)^(k·j))^k` ([`blocked_fp_rate_first_order`]),
//! replaces the number of set bits in a block by its mean; by Jensen's
//! inequality that is a *lower bound*, about 2–4 % low at p = 1 % and more at
//! smaller p. Sizing with it would systematically overshoot the target, so the
//! exact form is used (both are compared against simulation in the tests).
//!
//! Numerical note: the inclusion–exclusion sum alternates, so its absolute
//! error is about 2^k · 2⁻⁵² ≈ 1e-11; below p ≈ 1e-9 it is no longer
//! trustworthy and the result is floored by the first-order bound.

use super::FilterError;

/// Bits in one block: one 64-byte cache line.
pub const BLOCK_BITS: u64 = 512;
/// Smallest number of hash positions per key.
pub const MIN_HASHES: u32 = 1;
/// Largest number of hash positions per key. Beyond 16 the marginal gain in
/// bits/key is below 1 % for any p ≥ 1e-6 and every probe costs more.
pub const MAX_HASHES: u32 = 16;
/// Hard cap on filter size (2^38 bits = 32 GiB): requests beyond it are
/// configuration mistakes, refused with [`FilterError::TooLarge`] instead of
/// attempting the allocation.
pub const MAX_BITS: u64 = 1 << 38;
/// [`MAX_BITS`] in blocks.
pub const MAX_BLOCKS: u64 = MAX_BITS / BLOCK_BITS;

/// Classic optimal number of bits for `n` keys at false-positive rate `p`:
/// `⌊-n·ln p / (ln 2)²⌋` (truncated, as in the textbook tables:
/// `optimal_num_bits(1_000_000, 0.01) == 9_585_058`).
///
/// Saturates instead of overflowing. Out-of-range `p`: `p >= 1` needs no bits
/// (returns 0); `p <= 0` or NaN is unreachable by any finite filter (returns
/// `u64::MAX`). [`size_blocked`] is the validating entry point.
pub fn optimal_num_bits(n: u64, p: f64) -> u64 {
    if p.is_nan() || p <= 0.0 {
        return u64::MAX;
    }
    if p >= 1.0 {
        return 0;
    }
    let ln2 = std::f64::consts::LN_2;
    // `as` saturates for floats beyond u64::MAX.
    (-(n as f64) * p.ln() / (ln2 * ln2)).floor() as u64
}

/// Classic optimal number of hash functions for `n` keys in `m` bits,
/// `round(m/n · ln 2)`, clamped to `[MIN_HASHES, MAX_HASHES]`
/// (`n = 0` gives `MAX_HASHES`).
pub fn optimal_num_hashes(n: u64, m: u64) -> u32 {
    if n == 0 {
        return MAX_HASHES;
    }
    let k = (m as f64 / n as f64 * std::f64::consts::LN_2).round();
    (k as u32).clamp(MIN_HASHES, MAX_HASHES)
}

/// A blocked-layout size chosen by [`size_blocked`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockedSizing {
    /// Number of 512-bit blocks (≥ 1).
    pub num_blocks: u64,
    /// Bit positions per key, in `[MIN_HASHES, MAX_HASHES]`.
    pub num_hashes: u32,
    /// Model false-positive rate at the sized-for number of keys (≤ p).
    pub expected_fp_rate: f64,
}

impl BlockedSizing {
    /// Total bits.
    pub fn bits(&self) -> u64 {
        self.num_blocks * BLOCK_BITS
    }
    /// Total bytes of the bit array.
    pub fn bytes(&self) -> u64 {
        self.num_blocks * (BLOCK_BITS / 8)
    }
}

/// Rejects rates outside the open interval (0, 1) and NaN.
pub(crate) fn validate_rate(p: f64) -> Result<(), FilterError> {
    if p.is_nan() || p <= 0.0 || p >= 1.0 {
        Err(FilterError::InvalidRate(p))
    } else {
        Ok(())
    }
}

/// Smallest blocked filter whose modelled false-positive rate at `n` keys is
/// at most `p`, with the best k for that size.
///
/// `n = 0` gives the minimal filter (one block). Errors: `p` outside (0, 1)
/// or NaN ([`FilterError::InvalidRate`]); more than [`MAX_BITS`] needed
/// ([`FilterError::TooLarge`]).
pub fn size_blocked(n: u64, p: f64) -> Result<BlockedSizing, FilterError> {
    validate_rate(p)?;
    let mut best: Option<BlockedSizing> = None;
    for k in MIN_HASHES..=MAX_HASHES {
        if blocked_fp_rate(n, MAX_BLOCKS, k) > p {
            continue;
        }
        // FP rate falls monotonically with the number of blocks for fixed k:
        // binary search for the first block count that meets p.
        let (mut lo, mut hi) = (1u64, MAX_BLOCKS);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if blocked_fp_rate(n, mid, k) <= p {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let fp = blocked_fp_rate(n, lo, k);
        let candidate = BlockedSizing {
            num_blocks: lo,
            num_hashes: k,
            expected_fp_rate: fp,
        };
        // Fewest blocks wins; on a tie keep the lower FP rate (more margin).
        best = match best {
            Some(b) if b.num_blocks < lo || (b.num_blocks == lo && b.expected_fp_rate <= fp) => {
                Some(b)
            }
            _ => Some(candidate),
        };
    }
    best.ok_or(FilterError::TooLarge {
        keys: n,
        max_bits: MAX_BITS,
    })
}

/// Modelled false-positive rate of a blocked filter with `num_blocks` blocks
/// of 512 bits, `k` positions per key and `n` keys (see the module docs).
pub fn blocked_fp_rate(n: u64, num_blocks: u64, k: u32) -> f64 {
    let num_blocks = num_blocks.max(1);
    if n == 0 {
        return 0.0;
    }
    let k = k.clamp(MIN_HASHES, MAX_HASHES) as usize;
    let m = BLOCK_BITS as f64;
    let b = num_blocks as f64;
    let nf = n as f64;
    // E[x^J] for J ~ Binomial(n, 1/B): (1 - (1-x)/B)^n, via ln_1p for
    // accuracy when B is large.
    let pgf = |x: f64| (nf * (-(1.0 - x) / b).ln_1p()).exp();

    // g[i] = E[(1 - i/m)^(kJ)]: probability that i given positions are all
    // still clear in the query's block.
    let mut g = [0.0f64; MAX_HASHES as usize + 1];
    for (i, gi) in g.iter_mut().enumerate().take(k + 1) {
        *gi = pgf((1.0 - i as f64 / m).powi(k as i32));
    }

    // P(D = d) via Stirling numbers of the second kind S2(k, d).
    let mut s2 = [[0.0f64; MAX_HASHES as usize + 1]; MAX_HASHES as usize + 1];
    s2[0][0] = 1.0;
    for t in 1..=k {
        for d in 1..=t {
            s2[t][d] = d as f64 * s2[t - 1][d] + s2[t - 1][d - 1];
        }
    }
    let mut fp = 0.0;
    let mut falling = 1.0; // 512·511·…·(512-d+1) / 512^d
    for (d, &stirling) in s2[k].iter().enumerate().take(k + 1).skip(1) {
        falling *= (m - (d as f64 - 1.0)) / m;
        let p_d = stirling * falling / m.powi((k - d) as i32);
        let mut covered = 0.0;
        let mut binom = 1.0; // C(d, i)
        for (i, gi) in g.iter().enumerate().take(d + 1) {
            let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
            covered += sign * binom * gi;
            binom = binom * (d - i) as f64 / (i + 1) as f64;
        }
        fp += p_d * covered;
    }
    // Guard against cancellation at tiny rates (see module docs).
    fp.clamp(0.0, 1.0)
        .max(blocked_fp_rate_first_order(n, num_blocks, k as u32))
}

/// The most keys a blocked filter of this shape holds with a modelled
/// false-positive rate ([`blocked_fp_rate`]) of at most `rate`: the key count
/// at which the model crosses `rate`, precomputed once per filter so that a
/// live insert compares two integers instead of estimating the rate.
///
/// The model rises monotonically with the key count, so an exponential then
/// a binary search finds it in O(log n) evaluations (each O(k²)). `rate`
/// below the model at one key gives 0; a rate the model never reaches (≥ 1,
/// NaN) gives `u64::MAX`.
pub fn max_keys_at_rate(num_blocks: u64, k: u32, rate: f64) -> u64 {
    let within = |n: u64| blocked_fp_rate(n, num_blocks, k) <= rate;
    if rate.is_nan() || rate >= 1.0 {
        return u64::MAX;
    }
    if !within(1) {
        return 0;
    }
    // Past 2^48 keys the filter (at most 2^38 bits) is saturated anyway.
    let (mut lo, mut hi) = (1u64, 2u64);
    while within(hi) {
        if hi >= 1 << 48 {
            return u64::MAX;
        }
        lo = hi;
        hi *= 2;
    }
    // Invariant: within(lo), !within(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if within(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The commonly quoted first-order model
/// `Σ_j Pois(j; n/B) · (1 - (1-1/512)^(k·j))^k`: a lower bound on the true
/// rate (Jensen), kept for comparison and as a floor at tiny rates.
pub fn blocked_fp_rate_first_order(n: u64, num_blocks: u64, k: u32) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let k = k.clamp(MIN_HASHES, MAX_HASHES) as i32;
    let lambda = n as f64 / num_blocks.max(1) as f64;
    let q = (1.0 - 1.0 / BLOCK_BITS as f64).powi(k);
    let per_load = |j: f64| (1.0 - q.powf(j)).powi(k);
    // Sum the Poisson pmf outward from the mode; terms beyond 12 standard
    // deviations are below 1e-30 of the total.
    let spread = 12.0 * lambda.sqrt() + 20.0;
    let mode = lambda.floor();
    let ln_pmf = |j: f64| -lambda + j * lambda.ln() - ln_factorial(j);
    let p_mode = ln_pmf(mode).exp();
    let mut total = p_mode * per_load(mode);
    let mut pmf = p_mode;
    let mut j = mode;
    while j < mode + spread {
        pmf *= lambda / (j + 1.0);
        j += 1.0;
        total += pmf * per_load(j);
    }
    let mut pmf = p_mode;
    let mut j = mode;
    while j >= 1.0 && j > mode - spread {
        pmf *= j / lambda;
        j -= 1.0;
        total += pmf * per_load(j);
    }
    total.clamp(0.0, 1.0)
}

/// ln(j!) for integral j ≥ 0: exact summation for small j, Stirling series
/// (error < 1e-12) above.
fn ln_factorial(j: f64) -> f64 {
    if j < 32.0 {
        let mut acc = 0.0;
        let mut i = 2.0;
        while i <= j {
            acc += f64::ln(i);
            i += 1.0;
        }
        return acc;
    }
    let x = j + 1.0;
    (x - 0.5) * x.ln() - x + 0.5 * (2.0 * std::f64::consts::PI).ln() + 1.0 / (12.0 * x)
        - 1.0 / (360.0 * x * x * x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn classic_formulas_match_textbook_values() {
        assert_eq!(optimal_num_bits(1_000_000, 0.01), 9_585_058);
        assert_eq!(optimal_num_bits(1_000_000, 0.001), 14_377_587);
        assert_eq!(optimal_num_bits(0, 0.01), 0);
        assert_eq!(optimal_num_hashes(1_000_000, 9_585_058), 7);
        assert_eq!(optimal_num_hashes(1_000_000, 14_377_587), 10);
        assert_eq!(optimal_num_hashes(0, 1000), MAX_HASHES);
        assert_eq!(optimal_num_hashes(1_000_000, 1), MIN_HASHES);
        assert_eq!(optimal_num_hashes(1, u64::MAX), MAX_HASHES);
        // Saturation instead of overflow or panic.
        assert_eq!(optimal_num_bits(u64::MAX, 1e-300), u64::MAX);
        assert_eq!(optimal_num_bits(10, 0.0), u64::MAX);
        assert_eq!(optimal_num_bits(10, f64::NAN), u64::MAX);
        assert_eq!(optimal_num_bits(10, 1.0), 0);
    }

    #[test]
    fn rejects_nonsense_rates() {
        for p in [
            0.0,
            1.0,
            -0.5,
            1.5,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            assert!(
                matches!(size_blocked(1000, p), Err(FilterError::InvalidRate(_))),
                "p = {p} accepted"
            );
        }
    }

    #[test]
    fn empty_and_tiny_filters_are_one_block() {
        let s = size_blocked(0, 0.01).unwrap();
        assert_eq!(s.num_blocks, 1);
        let s = size_blocked(1, 0.01).unwrap();
        assert_eq!(s.num_blocks, 1);
        assert!(s.expected_fp_rate <= 0.01);
    }

    #[test]
    fn absurd_sizes_are_refused_not_overflowed() {
        assert!(matches!(
            size_blocked(u64::MAX, 1e-9),
            Err(FilterError::TooLarge { .. })
        ));
        // Just under the cap still works and never overflows in bits().
        let s = size_blocked(1 << 33, 0.5).unwrap();
        assert!(s.bits() <= MAX_BITS);
    }

    #[test]
    fn blocked_sizing_meets_target_with_small_overhead() {
        for (p, max_bits_per_key) in [(0.01, 11.0), (0.001, 16.5), (0.1, 5.6)] {
            let n = 1_000_000;
            let s = size_blocked(n, p).unwrap();
            assert!(s.expected_fp_rate <= p);
            // Minimality: one block fewer misses the target.
            assert!(blocked_fp_rate(n, s.num_blocks - 1, s.num_hashes) > p);
            let bpk = s.bits() as f64 / n as f64;
            let classic = optimal_num_bits(n, p) as f64 / n as f64;
            assert!(bpk > classic, "blocked must cost more than classic");
            assert!(bpk < max_bits_per_key, "p={p}: {bpk} bits/key");
        }
    }

    #[test]
    fn first_order_model_is_a_lower_bound() {
        for k in [1, 4, 7, 10, 16] {
            for bpk in [4u64, 8, 10, 16, 24] {
                let n = 100_000;
                let blocks = n * bpk / BLOCK_BITS;
                let exact = blocked_fp_rate(n, blocks, k);
                let first = blocked_fp_rate_first_order(n, blocks, k);
                assert!(first <= exact * (1.0 + 1e-9), "k={k} bpk={bpk}");
            }
        }
    }

    /// The model against a direct simulation of the process it describes:
    /// keys pick a uniformly random block and k uniform positions in it.
    #[test]
    fn exact_model_matches_simulation() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (num_blocks, k, n) = (64usize, 7u32, 64 * 512 / 8);
        let mut trials_fp = 0u64;
        let mut trials = 0u64;
        for _ in 0..40 {
            let mut blocks = vec![[0u64; 8]; num_blocks];
            for _ in 0..n {
                let b = rng.random_range(0..num_blocks);
                for _ in 0..k {
                    let pos = rng.random_range(0..512usize);
                    blocks[b][pos / 64] |= 1 << (pos % 64);
                }
            }
            for _ in 0..20_000 {
                let b = rng.random_range(0..num_blocks);
                let hit = (0..k).all(|_| {
                    let pos = rng.random_range(0..512usize);
                    blocks[b][pos / 64] & (1 << (pos % 64)) != 0
                });
                trials_fp += hit as u64;
                trials += 1;
            }
        }
        let measured = trials_fp as f64 / trials as f64;
        let exact = blocked_fp_rate(n as u64, num_blocks as u64, k);
        let first = blocked_fp_rate_first_order(n as u64, num_blocks as u64, k);
        // 800k trials at ~2.5 %: σ ≈ 0.7 % relative; allow 4σ.
        assert!(
            (measured - exact).abs() < 0.03 * exact,
            "measured {measured}, exact model {exact}, first-order {first}"
        );
        assert!(first < exact);
    }

    #[test]
    fn max_keys_at_rate_is_where_the_model_crosses() {
        for (n, p) in [
            (1_000u64, 0.01),
            (1_000_000, 0.01),
            (50_000, 0.001),
            (10, 0.1),
        ] {
            let s = size_blocked(n, p).unwrap();
            for multiple in [1.0, 2.0, 5.0] {
                let rate = p * multiple;
                let at = max_keys_at_rate(s.num_blocks, s.num_hashes, rate);
                assert!(at >= n, "sized for {n} at {p}, yet {rate} crossed at {at}");
                assert!(blocked_fp_rate(at, s.num_blocks, s.num_hashes) <= rate);
                assert!(blocked_fp_rate(at + 1, s.num_blocks, s.num_hashes) > rate);
            }
            // Twice the target is crossed well before the key count doubles
            // (for p = 1 %: at about 1.2 × n); not for a filter of one block,
            // whose minimum size leaves room to spare.
            let twice = max_keys_at_rate(s.num_blocks, s.num_hashes, 2.0 * p);
            assert!(s.num_blocks == 1 || twice < 2 * n, "{n} at {p}: {twice}");
        }
        assert_eq!(max_keys_at_rate(10, 7, 1.0), u64::MAX);
        assert_eq!(max_keys_at_rate(10, 7, f64::NAN), u64::MAX);
        assert_eq!(max_keys_at_rate(1, 1, 1e-12), 0);
    }

    #[test]
    fn ln_factorial_is_accurate() {
        let mut direct = 0.0;
        for j in 1..200u32 {
            direct += f64::ln(j as f64);
            let approx = ln_factorial(j as f64);
            assert!((approx - direct).abs() < 1e-9 * direct.max(1.0), "j={j}");
        }
    }
}
