//! Frame encoding and decoding, async (tokio) and blocking.

use crate::{Msg, ProtoError, MAGIC, MAX_FRAME, PROTOCOL_VERSION};
use bincode::Options;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const HEADER: usize = 12;

fn codec() -> impl bincode::Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(u64::from(MAX_FRAME))
        .reject_trailing_bytes()
}

/// Header flag: the body is zstd-compressed.
pub const FLAG_ZSTD: u16 = 1;
/// Bodies smaller than this are never worth compressing.
const COMPRESS_MIN: usize = 512;

/// Encode a message into one frame (header + body), uncompressed.
pub fn encode(msg: &Msg) -> Result<Vec<u8>, ProtoError> {
    encode_with(msg, false)
}

/// Encode a message; with `compress`, a body worth it is zstd-compressed
/// (kept only if that saves at least an eighth).
pub fn encode_with(msg: &Msg, compress: bool) -> Result<Vec<u8>, ProtoError> {
    // Serialize straight after a header placeholder: a frame of chunk data
    // is copied once, not once more to prepend its header.
    let mut out = Vec::with_capacity(HEADER + usize::try_from(codec().serialized_size(msg).unwrap_or(0)).unwrap_or(0));
    out.extend_from_slice(&[0u8; HEADER]);
    codec().serialize_into(&mut out, msg).map_err(ProtoError::Encode)?;
    let mut flags = 0u16;
    let body_len = out.len() - HEADER;
    if compress && body_len >= COMPRESS_MIN && msg.worth_compressing() {
        if let Ok(z) = zstd::bulk::compress(&out[HEADER..], 3) {
            if z.len() + body_len / 8 < body_len {
                out.truncate(HEADER);
                out.extend_from_slice(&z);
                flags |= FLAG_ZSTD;
            }
        }
    }
    let body_len = out.len() - HEADER;
    if body_len as u64 > u64::from(MAX_FRAME) {
        return Err(ProtoError::TooLarge(body_len as u64));
    }
    out[..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out[6..8].copy_from_slice(&flags.to_le_bytes());
    out[8..12].copy_from_slice(&u32::try_from(body_len).expect("checked against MAX_FRAME").to_le_bytes());
    Ok(out)
}

/// Check a header; returns the body length and flags.
pub fn parse_header(h: &[u8; HEADER]) -> Result<(usize, u16), ProtoError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(ProtoError::Version { peer: version, ours: PROTOCOL_VERSION });
    }
    let flags = u16::from_le_bytes([h[6], h[7]]);
    if flags & !FLAG_ZSTD != 0 {
        return Err(ProtoError::FrameFlags(flags));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len > MAX_FRAME {
        return Err(ProtoError::TooLarge(u64::from(len)));
    }
    Ok((len as usize, flags))
}

/// Decompress (bounded by the frame limit) if the flags say so, then decode.
pub fn decode_flagged(body: &[u8], flags: u16) -> Result<Msg, ProtoError> {
    if flags & FLAG_ZSTD != 0 {
        let plain = zstd::bulk::decompress(body, MAX_FRAME as usize)
            .map_err(ProtoError::Decompress)?;
        return decode(&plain);
    }
    decode(body)
}

/// Decode and validate a body.
pub fn decode(body: &[u8]) -> Result<Msg, ProtoError> {
    let msg: Msg = codec().deserialize(body).map_err(ProtoError::Decode)?;
    msg.validate()?;
    Ok(msg)
}

async fn read_exact_or<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8], at_start: bool) -> Result<(), ProtoError> {
    let mut got = 0;
    while got < buf.len() {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            return Err(if got == 0 && at_start {
                ProtoError::Closed
            } else {
                ProtoError::Truncated { expected: buf.len(), got }
            });
        }
        got += n;
    }
    Ok(())
}

/// Read one frame. `Closed` means a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Msg, ProtoError> {
    let mut h = [0u8; HEADER];
    read_exact_or(r, &mut h, true).await?;
    let (len, flags) = parse_header(&h)?;
    let mut body = vec![0u8; len];
    read_exact_or(r, &mut body, false).await?;
    decode_flagged(&body, flags)
}

pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, msg: &Msg) -> Result<(), ProtoError> {
    let buf = encode(msg)?;
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Blocking frame reader over any `std::io::Read`.
pub struct FrameReader<R>(pub R);
impl<R: std::io::Read> FrameReader<R> {
    pub fn read(&mut self) -> Result<Msg, ProtoError> {
        let mut h = [0u8; HEADER];
        let mut got = 0;
        while got < HEADER {
            let n = self.0.read(&mut h[got..])?;
            if n == 0 {
                return Err(if got == 0 { ProtoError::Closed } else { ProtoError::Truncated { expected: HEADER, got } });
            }
            got += n;
        }
        let (len, flags) = parse_header(&h)?;
        let mut body = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = self.0.read(&mut body[got..])?;
            if n == 0 {
                return Err(ProtoError::Truncated { expected: len, got });
            }
            got += n;
        }
        decode_flagged(&body, flags)
    }
}

/// Blocking frame writer over any `std::io::Write`.
pub struct FrameWriter<W>(pub W);
impl<W: std::io::Write> FrameWriter<W> {
    pub fn write(&mut self, msg: &Msg) -> Result<(), ProtoError> {
        self.0.write_all(&encode(msg)?)?;
        self.0.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;

    /// Chunk bytes are a bincode byte string: the same bytes a `Vec<u8>` was
    /// written as before (u64 length, then the bytes), so the wire is unchanged.
    #[test]
    fn chunk_bytes_encode_as_a_length_prefixed_byte_string() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let c = ChunkData::seal(&data, false);
        let enc = codec().serialize(&c).unwrap();
        let mut want = c.hash.0.to_vec();
        want.push(0); // compressed: false
        want.extend_from_slice(&1000u64.to_le_bytes());
        want.extend_from_slice(&data);
        assert_eq!(enc, want);
        let back: ChunkData = codec().deserialize(&enc).unwrap();
        assert_eq!(back.into_verified().unwrap(), data);
    }

    #[test]
    fn sealed_chunks_verify_and_incompressible_ones_go_as_is() {
        let text = b"compressible text ".repeat(4096);
        let z = ChunkData::seal(&text, true);
        assert!(z.compressed && z.data.len() < text.len() / 4);
        assert_eq!(z.open().unwrap(), text);
        // Random bytes: not compressed (the prefix sample says so).
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect();
        let n = ChunkData::seal(&noise, true);
        assert!(!n.compressed);
        assert_eq!(n.data, noise);
        // seal_named trusts the caller's name; the receiver does not.
        let lie = ChunkData::seal_named(Hash::of(b"something else"), noise.clone(), false);
        assert!(matches!(lie.into_verified(), Err(ProtoError::Invalid(Invalid::ChunkMismatch(_)))));
    }

    fn spec() -> TaskSpec {
        TaskSpec {
            env: vec![(b"A".to_vec(), b"1".to_vec())],
            ..TaskSpec::new(vec![b"true".to_vec()], WirePath::new(b"/tmp".to_vec()).unwrap())
        }
    }

    #[tokio::test]
    async fn roundtrip() {
        let m = Msg::Launch { spec: spec(), reference: 1 };
        let buf = encode(&m).unwrap();
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r).await.unwrap(), m);
        assert!(matches!(read_frame(&mut r).await, Err(ProtoError::Closed)));
    }

    #[tokio::test]
    async fn truncated_frame_is_an_error() {
        let buf = encode(&Msg::Ping { nonce: 7 }).unwrap();
        for cut in 1..buf.len() {
            let mut r = &buf[..cut];
            let e = read_frame(&mut r).await.unwrap_err();
            assert!(matches!(e, ProtoError::Truncated { .. }), "cut at {cut}: {e}");
        }
    }

    #[tokio::test]
    async fn other_version_is_refused() {
        let mut buf = encode(&Msg::Ping { nonce: 7 }).unwrap();
        buf[4] = 9;
        let e = read_frame(&mut &buf[..]).await.unwrap_err();
        assert!(matches!(e, ProtoError::Version { peer: 9, ours: PROTOCOL_VERSION }));
        assert!(e.to_string().contains("v9"));
    }

    #[tokio::test]
    async fn garbage_and_oversize_are_refused() {
        let e = read_frame(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).await.unwrap_err();
        assert!(matches!(e, ProtoError::BadMagic(_)));
        let mut buf = encode(&Msg::Ping { nonce: 7 }).unwrap();
        buf[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(read_frame(&mut &buf[..]).await.unwrap_err(), ProtoError::TooLarge(_)));
    }

    #[test]
    fn random_bodies_never_panic() {
        // A cheap deterministic fuzz: every byte string decodes to an error or a valid message.
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for n in 0..20_000usize {
            let len = n % 97;
            let body: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()[0]
                })
                .collect();
            if let Ok(m) = decode(&body) {
                m.validate().unwrap();
            }
        }
    }

    #[tokio::test]
    async fn compressed_frames_roundtrip_and_shrink() {
        let mut s = spec();
        s.env = (0..200).map(|i| (format!("VAR{i}").into_bytes(), b"/usr/local/bin:/usr/bin:/bin".to_vec())).collect();
        let m = Msg::Launch { spec: s, reference: 1 };
        let plain = encode(&m).unwrap();
        let z = encode_with(&m, true).unwrap();
        assert!(z.len() * 3 < plain.len(), "{} vs {}", z.len(), plain.len());
        assert_eq!(read_frame(&mut &z[..]).await.unwrap(), m);
        let mut bad = z.clone();
        bad[6] = 0x80;
        assert!(read_frame(&mut &bad[..]).await.is_err(), "unknown flags are refused");
    }

    #[test]
    fn invalid_paths_are_rejected() {
        let long_name = [b"/a/".to_vec(), vec![b'n'; 256]].concat();
        let long_path = [b"/".to_vec(), vec![b'n'; 4096]].concat();
        for bad in [&b"rel"[..], b"/a/../b", b"/..", b"/a//b", b"/a/./b", b"/a\0b", b"", &long_name, &long_path] {
            assert!(WirePath::new(bad.to_vec()).is_err(), "{:?}", bad);
        }
        assert!(WirePath::new([b"/a/".to_vec(), vec![b'n'; 255]].concat()).is_ok(), "NAME_MAX itself is fine");
        let enc = |m: &Msg| bincode::DefaultOptions::new().with_fixint_encoding().serialize(m).unwrap();
        // Refused by the decoder itself: every field that is a WirePath, in every message.
        let mut s = spec();
        s.cwd = WirePath(b"/x/..".to_vec());
        let err = decode(&enc(&Msg::Launch { spec: s, reference: 1 })).unwrap_err();
        assert!(matches!(err, ProtoError::Decode(_)), "{err:?}");
        assert!(err.to_string().contains("not normalised") || format!("{err:?}").contains("not normalised"), "{err:?}");
        let change = |p: Vec<u8>| Msg::Finished {
            task: crate::TaskId(1),
            status: crate::ExitStatus::Code(0),
            changes: vec![crate::Change::Remove { path: WirePath(p), base: crate::Base::Absent }],
            accessed: vec![],
        };
        for bad in [b"/w/../../etc/passwd".to_vec(), b"/w/a\0b".to_vec(), long_name.clone(), b"etc/passwd".to_vec()] {
            assert!(decode(&enc(&change(bad.clone()))).is_err(), "{:?}", String::from_utf8_lossy(&bad));
        }
        assert!(decode(&enc(&change(b"/w/ok".to_vec()))).is_ok());
        // Outside frames too (migration payloads, caches): plain bincode refuses it.
        let raw = bincode::serialize(&WirePath(b"/a/../b".to_vec())).unwrap();
        assert!(bincode::deserialize::<WirePath>(&raw).is_err());
    }

    #[test]
    fn chunks_are_verified() {
        let data = vec![7u8; 10000];
        let c = ChunkData::seal(&data, true);
        assert!(c.compressed);
        assert_eq!(c.open().unwrap(), data);
        let mut bad = c.clone();
        bad.hash = Hash::of(b"other");
        assert!(bad.open().is_err());
        let mut noise = vec![0u8; 10000];
        blake3::Hasher::new().update(b"seed").finalize_xof().fill(&mut noise);
        assert!(!ChunkData::seal(&noise, true).compressed, "incompressible data is sent raw");
    }
}
