//! Signal dispositions and queued signals.

/// Signals 1..=64 (index = signal number - 1).
pub const N_SIGNALS: usize = 64;

/// The kernel's `struct sigaction` for `rt_sigaction` on x86-64.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct Sigaction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

/// All 64 dispositions of a process (index = signal number - 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SigactionTable(pub [Sigaction; N_SIGNALS]);

impl Default for SigactionTable {
    fn default() -> Self {
        SigactionTable([Sigaction { handler: 0, flags: 0, restorer: 0, mask: 0 }; N_SIGNALS])
    }
}

/// Size of the kernel's `siginfo_t`.
pub const SIGINFO_BYTES: usize = 128;

/// One queued signal: the kernel's `siginfo_t` as `PTRACE_PEEKSIGINFO`
/// returns it and `rt_tgsigqueueinfo` takes it (opaque: its union depends on
/// the signal and its code).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SigInfo(pub [u64; SIGINFO_BYTES / 8]);

impl SigInfo {
    /// The signal number (`si_signo`, the first `int`).
    pub const fn signo(&self) -> u32 {
        // The low 32 bits of the first word are `si_signo` (little-endian x86-64): truncation is the point.
        #[allow(clippy::cast_possible_truncation)]
        let signo = self.0[0] as u32;
        signo
    }
}

#[cfg(feature = "std")]
mod serde_impls {
    //! serde has no impls for arrays longer than 32: these go as tuples.
    use super::*;
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::ser::SerializeTuple;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    fn ser_array<T: Serialize, S: Serializer>(items: &[T], s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(items.len())?;
        for i in items {
            t.serialize_element(i)?;
        }
        t.end()
    }

    struct ArrayVisitor<T, const N: usize>(core::marker::PhantomData<T>);

    impl<'de, T: Deserialize<'de> + Copy + Default, const N: usize> Visitor<'de> for ArrayVisitor<T, N> {
        type Value = [T; N];
        fn expecting(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
            write!(f, "an array of {N}")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<[T; N], A::Error> {
            let mut out = [T::default(); N];
            for (i, slot) in out.iter_mut().enumerate() {
                *slot = seq.next_element()?.ok_or_else(|| A::Error::invalid_length(i, &self))?;
            }
            Ok(out)
        }
    }

    fn de_array<'de, T: Deserialize<'de> + Copy + Default, const N: usize, D: Deserializer<'de>>(d: D) -> Result<[T; N], D::Error> {
        d.deserialize_tuple(N, ArrayVisitor::<T, N>(core::marker::PhantomData))
    }

    impl Serialize for SigactionTable {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            ser_array(&self.0, s)
        }
    }
    impl<'de> Deserialize<'de> for SigactionTable {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            de_array::<Sigaction, N_SIGNALS, D>(d).map(SigactionTable)
        }
    }
    impl Serialize for SigInfo {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            ser_array(&self.0, s)
        }
    }
    impl<'de> Deserialize<'de> for SigInfo {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            de_array::<u64, { SIGINFO_BYTES / 8 }, D>(d).map(SigInfo)
        }
    }
}
