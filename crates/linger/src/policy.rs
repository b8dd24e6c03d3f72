//! The seed's cost/benefit arithmetic (§3.3), used by the head's LL policy
//! (the policies themselves: `starling_config::GuestPolicy`).

use std::time::Duration;

/// Eq. 3.4: how long a guest should linger on a host whose owner uses `h`
/// of the CPU before moving to one whose owner uses `l` (`l < h`), when a
/// move costs `t_migr` (eq. 3.5). `None` when moving never pays (`h ≤ l`).
pub fn t_lingr(l: f64, h: f64, t_migr: Duration) -> Option<Duration> {
    if !(0.0..=1.0).contains(&l) || !(0.0..=1.0).contains(&h) || h <= l {
        return None;
    }
    Duration::try_from_secs_f64((1.0 - l) / (h - l) * t_migr.as_secs_f64()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t_lingr_matches_the_seed_examples() {
        // §4 of the design note: l = 0, h = 0.2: T_lingr = 5·T_migr; h = 0.8: 1.25·T_migr.
        let t = Duration::from_secs(21);
        assert!((t_lingr(0.0, 0.2, t).unwrap().as_secs_f64() - 105.0).abs() < 1e-9);
        assert!((t_lingr(0.0, 0.8, t).unwrap().as_secs_f64() - 26.25).abs() < 1e-9);
        assert_eq!(t_lingr(0.3, 0.3, t), None);
        assert_eq!(t_lingr(0.5, 0.2, t), None);
    }
}
