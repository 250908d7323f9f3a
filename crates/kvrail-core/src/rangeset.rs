//! Which byte ranges of a transfer have been placed: completion is counted by
//! ranges, not slices, so a slice re-sent after a failover is never counted twice.

/// Disjoint, sorted, half-open ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    ranges: Vec<(u64, u64)>,
    covered: u64,
}

impl RangeSet {
    /// Adds `[start, end)`; returns how many bytes were not covered before.
    pub fn insert(&mut self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        // First range that ends at or after `start` (touching ranges merge).
        let first = self.ranges.partition_point(|r| r.1 < start);
        let mut new_start = start;
        let mut new_end = end;
        let mut overlap = 0;
        let mut last = first;
        while last < self.ranges.len() && self.ranges[last].0 <= end {
            let (s, e) = self.ranges[last];
            overlap += e.min(end).saturating_sub(s.max(start));
            new_start = new_start.min(s);
            new_end = new_end.max(e);
            last += 1;
        }
        self.ranges.splice(first..last, [(new_start, new_end)]);
        let added = (end - start) - overlap;
        self.covered += added;
        added
    }

    /// Bytes covered.
    pub fn covered(&self) -> u64 {
        self.covered
    }

    /// Whether `[0, total)` is fully covered.
    pub fn is_complete(&self, total: u64) -> bool {
        self.covered == total && (total == 0 || self.ranges == [(0, total)])
    }

    /// Whether `[start, end)` is already fully covered.
    pub fn contains(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return true;
        }
        let i = self.ranges.partition_point(|r| r.1 < end);
        self.ranges
            .get(i)
            .is_some_and(|&(s, e)| s <= start && end <= e)
    }

    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::seq::SliceRandom;

    #[test]
    fn duplicate_and_overlapping_inserts_count_once() {
        let mut r = RangeSet::default();
        assert_eq!(r.insert(10, 20), 10);
        assert_eq!(r.insert(10, 20), 0);
        assert!(r.contains(10, 20) && r.contains(12, 15));
        assert!(!r.contains(5, 15) && !r.contains(15, 25) && !r.contains(30, 40));
        assert_eq!(r.insert(15, 30), 10);
        assert_eq!(r.insert(0, 5), 5);
        assert_eq!(r.ranges(), &[(0, 5), (10, 30)]);
        assert_eq!(r.insert(5, 10), 5);
        assert_eq!(r.ranges(), &[(0, 30)]);
        assert!(r.is_complete(30));
        assert!(!r.is_complete(31));
    }

    #[test]
    fn random_slices_with_repeats_complete_exactly() {
        let mut rng = rand::rng();
        let mut slices: Vec<(u64, u64)> = (0..200).map(|i| (i * 7, i * 7 + 7)).collect();
        let repeats: Vec<_> = slices.iter().step_by(3).copied().collect();
        slices.extend(repeats);
        slices.shuffle(&mut rng);
        let mut r = RangeSet::default();
        let added: u64 = slices.iter().map(|(s, e)| r.insert(*s, *e)).sum();
        assert_eq!(added, 1400);
        assert!(r.is_complete(1400));
    }
}
