//! The roaming manager's X sensors (issue 11 part 4): what one relayed X connection carries,
//! counted as it passes (`crate::x11`'s pumps hand each chunk over; nothing is copied but a
//! unit header split across two chunks).
//!
//! Server → client: input events (core KeyPress, KeyRelease, ButtonPress, ButtonRelease,
//! MotionNotify; XInput2's key, button, motion and touch events inside GenericEvents), after the
//! setup reply, framed as the core protocol says: errors and events are 32 bytes, replies and
//! GenericEvents 32 plus 4 × their length field. Events sent by another client (`SendEvent`,
//! the type's top bit) are not the user's and are not counted.
//!
//! Client → server: drawing requests (core ClearArea, CopyArea, CopyPlane, PolyPoint …
//! PolyFillArc, PutImage, PolyText8/16, ImageText8/16; MIT-SHM PutImage; RENDER's compositing,
//! trapezoid, triangle, glyph and fill requests; GLX Render, RenderLarge and SwapBuffers;
//! Present Pixmap), framed by each request's length (BIG-REQUESTS' extended length when it is
//! 0). Extension requests are known by the major opcodes the server gave in its answers to the
//! connection's own QueryExtension requests (matched by sequence number).

use std::collections::VecDeque;
use x11rb_protocol::protocol::xproto;

/// MIT-SHM's PutImage (shmproto).
const SHM_PUT_IMAGE: u8 = 3;
/// RENDER's drawing requests (renderproto): Composite 8, Trapezoids 10, Triangles 11,
/// TriStrip 12, TriFan 13, CompositeGlyphs8/16/32 23–25, FillRectangles 26, AddTraps 32.
const RENDER_DRAWING: [u8; 10] = [8, 10, 11, 12, 13, 23, 24, 25, 26, 32];
/// GLX (glxproto): Render 1, RenderLarge 2 (indirect rendering's command buffers), SwapBuffers 11.
const GLX_DRAWING: [u8; 3] = [1, 2, 11];
/// Present's Pixmap (presentproto).
const PRESENT_PIXMAP: u8 = 1;
/// XInput2's device events (XI2proto): KeyPress 2 … Motion 6, TouchBegin 18 … TouchEnd 20.
const XI2_INPUT: [u16; 8] = [2, 3, 4, 5, 6, 18, 19, 20];
/// A SendEvent's event: the type's top bit.
const SENT: u8 = 0x80;
/// Extension names longer than this are never ones we look for.
const MAX_NAME: usize = 32;

/// The extensions whose requests or events are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ext {
    Shm,
    Render,
    Glx,
    Present,
    Input,
}

impl Ext {
    fn named(name: &[u8]) -> Option<Ext> {
        Some(match name {
            b"MIT-SHM" => Ext::Shm,
            b"RENDER" => Ext::Render,
            b"GLX" => Ext::Glx,
            b"Present" => Ext::Present,
            b"XInputExtension" => Ext::Input,
            _ => return None,
        })
    }
}

/// A unit (request, reply, event) being looked at: how many header bytes deciding takes, or
/// its whole length once decided.
enum Unit {
    Need(usize),
    Len(usize),
}

/// Walks the units of one direction's byte stream across chunks.
#[derive(Default)]
struct Framer {
    /// A header split across chunks (at most 8 + [`MAX_NAME`] or 32 bytes).
    head: Vec<u8>,
    /// Bytes of the current unit still to pass over.
    skip: usize,
}

impl Framer {
    /// `look` sees the start of a unit (at least what it last asked for, when there is that
    /// much) and says what it needs or, having counted it, its length.
    fn walk(&mut self, mut data: &[u8], mut look: impl FnMut(&[u8]) -> Unit) {
        loop {
            let n = self.skip.min(data.len());
            self.skip -= n;
            data = &data[n..];
            if data.is_empty() {
                return;
            }
            if self.head.is_empty() {
                // The usual case: the header is all in this chunk, looked at in place.
                match look(data) {
                    Unit::Len(len) => self.skip = len.max(1),
                    Unit::Need(_) => {
                        self.head.extend_from_slice(data);
                        return;
                    }
                }
                continue;
            }
            loop {
                match look(&self.head) {
                    Unit::Len(len) => {
                        self.skip = len.saturating_sub(self.head.len());
                        self.head.clear();
                        break;
                    }
                    Unit::Need(want) => {
                        let take = want.saturating_sub(self.head.len()).min(data.len()).max(1).min(data.len());
                        self.head.extend_from_slice(&data[..take]);
                        data = &data[take..];
                        if data.is_empty() && self.head.len() < want {
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// One X connection as it passes through the relay: what it has counted so far is returned by
/// each call, the state between calls is the framing and the extension table.
pub struct XStream {
    big_endian: bool,
    requests: Framer,
    answers: Framer,
    /// The server's setup reply has been passed over.
    set_up: bool,
    /// The sequence number of the client's last request (its low 16 bits, as replies carry it).
    seq: u16,
    /// QueryExtension requests not answered yet: (sequence number, extension).
    asked: Vec<(u16, Ext)>,
    /// Major opcodes of the extensions the server has (0: not known).
    majors: [(Ext, u8); 5],
}

impl XStream {
    /// A connection whose setup request began with `order` (`B`: big-endian, `l`: little).
    pub fn new(order: u8) -> XStream {
        XStream {
            big_endian: order == b'B',
            requests: Framer::default(),
            answers: Framer::default(),
            set_up: false,
            seq: 0,
            asked: Vec::new(),
            majors: [(Ext::Shm, 0), (Ext::Render, 0), (Ext::Glx, 0), (Ext::Present, 0), (Ext::Input, 0)],
        }
    }

    fn u16_at(&self, b: &[u8], i: usize) -> u16 {
        let v = [b[i], b[i + 1]];
        if self.big_endian {
            u16::from_be_bytes(v)
        } else {
            u16::from_le_bytes(v)
        }
    }

    fn u32_at(&self, b: &[u8], i: usize) -> u32 {
        let v = [b[i], b[i + 1], b[i + 2], b[i + 3]];
        if self.big_endian {
            u32::from_be_bytes(v)
        } else {
            u32::from_le_bytes(v)
        }
    }

    fn ext(&self, major: u8) -> Option<Ext> {
        self.majors.iter().find(|(_, m)| *m != 0 && *m == major).map(|(e, _)| *e)
    }

    fn major(&self, ext: Ext) -> u8 {
        self.majors.iter().find(|(e, _)| *e == ext).map_or(0, |(_, m)| *m)
    }

    /// Bytes the client sent after its setup request: how many drawing requests begin in them.
    pub fn client_sent(&mut self, data: &[u8]) -> u32 {
        let mut framer = std::mem::take(&mut self.requests);
        let mut drawing = 0;
        framer.walk(data, |h| self.request(h, &mut drawing));
        self.requests = framer;
        drawing
    }

    fn request(&mut self, h: &[u8], drawing: &mut u32) -> Unit {
        if h.len() < 4 {
            return Unit::Need(4);
        }
        let (len, body) = match self.u16_at(h, 2) {
            // BIG-REQUESTS: the length (in 4-byte units) follows the header.
            0 if h.len() < 8 => return Unit::Need(8),
            0 => (usize::try_from(self.u32_at(h, 4)).unwrap_or(usize::MAX).saturating_mul(4), 8),
            n => (usize::from(n) * 4, 4),
        };
        let (opcode, minor) = (h[0], h[1]);
        if opcode == xproto::QUERY_EXTENSION_REQUEST {
            // CARD16 name length, 2 unused, the name.
            if h.len() < body + 4 {
                return Unit::Need(body + 4);
            }
            let n = usize::from(self.u16_at(h, body));
            if n <= MAX_NAME && h.len() < body + 4 + n {
                return Unit::Need(body + 4 + n);
            }
            if let Some(ext) = h.get(body + 4..body + 4 + n).and_then(Ext::named) {
                self.asked.push((self.seq.wrapping_add(1), ext));
            }
        }
        self.seq = self.seq.wrapping_add(1);
        let draws = match opcode {
            xproto::CLEAR_AREA_REQUEST
            | xproto::COPY_AREA_REQUEST
            | xproto::COPY_PLANE_REQUEST
            | xproto::POLY_POINT_REQUEST..=xproto::POLY_FILL_ARC_REQUEST
            | xproto::PUT_IMAGE_REQUEST
            | xproto::POLY_TEXT8_REQUEST..=xproto::IMAGE_TEXT16_REQUEST => true,
            o if o >= 128 => match self.ext(o) {
                Some(Ext::Shm) => minor == SHM_PUT_IMAGE,
                Some(Ext::Render) => RENDER_DRAWING.contains(&minor),
                Some(Ext::Glx) => GLX_DRAWING.contains(&minor),
                Some(Ext::Present) => minor == PRESENT_PIXMAP,
                _ => false,
            },
            _ => false,
        };
        *drawing += u32::from(draws);
        Unit::Len(len)
    }

    /// Bytes the server sent (from its setup reply on): how many input events are in them.
    pub fn server_sent(&mut self, data: &[u8]) -> u32 {
        let mut framer = std::mem::take(&mut self.answers);
        let mut inputs = 0;
        framer.walk(data, |h| self.answer(h, &mut inputs));
        self.answers = framer;
        inputs
    }

    fn answer(&mut self, h: &[u8], inputs: &mut u32) -> Unit {
        if !self.set_up {
            // Failed, Success or Authenticate alike: 8 bytes, then 4 × the CARD16 at 6.
            if h.len() < 8 {
                return Unit::Need(8);
            }
            self.set_up = true;
            return Unit::Len(8 + 4 * usize::from(self.u16_at(h, 6)));
        }
        if h.len() < 32 {
            return Unit::Need(32);
        }
        let long = 32 + usize::try_from(self.u32_at(h, 4)).unwrap_or(usize::MAX).saturating_mul(4);
        match h[0] {
            // An error.
            0 => Unit::Len(32),
            1 => {
                // A reply: to a QueryExtension of ours, its BOOL present and CARD8 major opcode.
                let seq = self.u16_at(h, 2);
                if let Some(i) = self.asked.iter().position(|(s, _)| *s == seq) {
                    let (_, ext) = self.asked.swap_remove(i);
                    if h[8] != 0 {
                        if let Some(slot) = self.majors.iter_mut().find(|(e, _)| *e == ext) {
                            slot.1 = h[9];
                        }
                    }
                }
                Unit::Len(long)
            }
            xproto::GE_GENERIC_EVENT => {
                // CARD8 extension, CARD16 sequence, CARD32 length, CARD16 event type.
                let input = self.major(Ext::Input);
                if input != 0 && h[1] == input && XI2_INPUT.contains(&self.u16_at(h, 8)) {
                    *inputs += 1;
                }
                Unit::Len(long)
            }
            t if t & SENT != 0 && t & !SENT == xproto::GE_GENERIC_EVENT => Unit::Len(long),
            xproto::KEY_PRESS_EVENT..=xproto::MOTION_NOTIFY_EVENT => {
                *inputs += 1;
                Unit::Len(32)
            }
            _ => Unit::Len(32),
        }
    }
}

/// Input events and the drawing after each, over time: Snowbird's smoothness sensor. Each frame
/// (a chunk from the program holding a drawing request: one flush of its buffer) is put down to
/// the latest input; an input followed by n frames, the last T after it, is n/T frames per
/// second.
#[derive(Default)]
pub struct XInteraction {
    inputs: VecDeque<(std::time::Instant, u32)>,
    /// The latest input, and the frames since: (input, frames, the last one).
    episode: Option<(std::time::Instant, u32, std::time::Instant)>,
    /// Each finished episode's frames per second, at its last frame.
    fps: VecDeque<(std::time::Instant, f64)>,
}

/// Frames per second of `n` frames, the last `t` after the input (at least 1 ms: a frame can
/// come in the same instant as far as the clock tells).
fn rate(n: u32, t: std::time::Duration) -> f64 {
    f64::from(n) / t.as_secs_f64().max(1e-3)
}

impl XInteraction {
    /// `n` input events arrived for the program.
    pub fn input(&mut self, at: std::time::Instant, n: u32) {
        self.inputs.push_back((at, n));
        if let Some((t, frames, last)) = self.episode.take().filter(|e| e.1 > 0) {
            self.fps.push_back((last, rate(frames, last.saturating_duration_since(t))));
        }
        self.episode = Some((at, 0, at));
    }

    /// The program sent a frame (a chunk with drawing in it).
    pub fn frame(&mut self, at: std::time::Instant) {
        if let Some((_, frames, last)) = self.episode.as_mut() {
            *frames += 1;
            *last = at;
        }
    }

    /// Input events over the `window` before `now`, and the mean frames per second of the
    /// inputs answered in it (the latest one's so far included); older ones are forgotten.
    pub fn averaged(&mut self, now: std::time::Instant, window: std::time::Duration) -> (f64, Option<f64>) {
        let start = now.checked_sub(window).unwrap_or(now);
        while self.inputs.front().is_some_and(|(t, _)| *t < start) {
            self.inputs.pop_front();
        }
        while self.fps.front().is_some_and(|(t, _)| *t < start) {
            self.fps.pop_front();
        }
        let open = self.episode.filter(|(_, n, last)| *n > 0 && *last >= start).map(|(t, n, last)| rate(n, last.saturating_duration_since(t)));
        let all: Vec<f64> = self.fps.iter().map(|(_, f)| *f).chain(open).collect();
        let fps = (!all.is_empty()).then(|| all.iter().sum::<f64>() / all.len() as f64);
        (f64::from(self.inputs.iter().fold(0u32, |sum, (_, n)| sum.saturating_add(*n))), fps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    // Test vectors written from the X11 core protocol spec (the encoding appendix), little-endian.

    /// The setup reply's fixed part, Success, with 2 units (8 bytes) of additional data.
    const SETUP_REPLY: [u8; 16] = [1, 0, 11, 0, 0, 0, 2, 0, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa];

    fn event(code: u8) -> [u8; 32] {
        let mut e = [0u8; 32];
        e[0] = code;
        e[2] = 7; // sequence
        e
    }

    /// A reply of 32 + 4 × `extra` bytes, to sequence number `seq`, whose body bytes are all 2
    /// (as a KeyPress code would be: it must not be taken for one).
    fn reply(seq: u16, extra: u32) -> Vec<u8> {
        let mut r = vec![2u8; 32 + 4 * extra as usize];
        r[0] = 1;
        r[1] = 0;
        r[2..4].copy_from_slice(&seq.to_le_bytes());
        r[4..8].copy_from_slice(&extra.to_le_bytes());
        r
    }

    /// QueryExtension(name) (opcode 98): length 2 + (n + p)/4.
    fn query_extension(name: &[u8]) -> Vec<u8> {
        let padded = name.len().div_ceil(4) * 4;
        let mut r = vec![98, 0];
        r.extend_from_slice(&u16::try_from(2 + padded / 4).unwrap().to_le_bytes());
        r.extend_from_slice(&u16::try_from(name.len()).unwrap().to_le_bytes());
        r.extend_from_slice(&[0, 0]);
        r.extend_from_slice(name);
        r.resize(8 + padded, 0);
        r
    }

    /// QueryExtension's reply: present, major opcode `major`.
    fn extension_reply(seq: u16, major: u8) -> Vec<u8> {
        let mut r = reply(seq, 0);
        r[8..12].copy_from_slice(&[1, major, 0, 0]);
        r
    }

    fn server_stream(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn input_events_are_counted_and_replies_errors_and_other_events_are_not() {
        let stream = server_stream(&[
            &SETUP_REPLY,
            &event(2),  // KeyPress
            &event(12), // Expose
            &reply(3, 3),
            &event(3), // KeyRelease
            &[0u8; 32], // an error
            &event(4),
            &event(5),
            &event(6), // ButtonPress, ButtonRelease, MotionNotify
            &event(0x80 | 2), // a KeyPress sent by another client
            &event(7), // EnterNotify
        ]);
        let mut x = XStream::new(b'l');
        assert_eq!(x.server_sent(&stream), 5);
        // Byte by byte: the same count (headers split across chunks).
        let mut x = XStream::new(b'l');
        assert_eq!(stream.iter().map(|b| x.server_sent(std::slice::from_ref(b))).sum::<u32>(), 5);
    }

    #[test]
    fn big_endian_lengths_are_read_big_endian() {
        // Setup reply with 1 unit of additional data, then a reply of 1 extra unit, a KeyPress.
        let setup = [1, 0, 0, 11, 0, 0, 0, 1, 2, 2, 2, 2];
        let mut r = vec![2u8; 36];
        r[..8].copy_from_slice(&[1, 0, 0, 1, 0, 0, 0, 1]);
        let mut x = XStream::new(b'B');
        assert_eq!(x.server_sent(&server_stream(&[&setup, &r, &event(2)])), 1);
    }

    #[test]
    fn xinput2_events_count_once_the_extension_is_known() {
        let mut x = XStream::new(b'l');
        // Requests 1 and 2: a NoOperation (127), then QueryExtension("XInputExtension").
        assert_eq!(x.client_sent(&[127, 0, 1, 0]), 0);
        assert_eq!(x.client_sent(&query_extension(b"XInputExtension")), 0);
        // A GenericEvent (35) of XInput (major 131), XI_Motion (6), 2 extra units.
        let mut ge = vec![0u8; 40];
        ge[..10].copy_from_slice(&[35, 131, 9, 0, 2, 0, 0, 0, 6, 0]);
        assert_eq!(x.server_sent(&server_stream(&[&SETUP_REPLY, &ge])), 0, "not known yet: not counted");
        assert_eq!(x.server_sent(&server_stream(&[&extension_reply(2, 131), &ge])), 1);
        // XI_Enter (7) is not an input; another extension's GenericEvent is not XInput's.
        ge[8] = 7;
        assert_eq!(x.server_sent(&ge), 0);
        ge[8] = 2;
        ge[1] = 140;
        assert_eq!(x.server_sent(&ge), 0);
    }

    #[test]
    fn drawing_requests_are_counted_across_chunks_and_big_requests() {
        let stream: Vec<u8> = [
            &[72u8, 2, 6, 0][..], // PutImage, 6 units
            &[0; 20],
            &[70, 0, 5, 0], // PolyFillRectangle, 5 units
            &[0; 16],
            &[18, 0, 6, 0], // ChangeProperty (not drawing), 6 units
            &[0; 20],
            &[72, 2, 0, 0, 4, 0, 0, 0], // PutImage, BIG-REQUESTS length 4 units
            &[0; 8],
            &[76, 3, 4, 0], // ImageText8, 4 units
            &[0; 12],
            &[61, 0, 4, 0], // ClearArea
            &[0; 12],
            &[62, 0, 7, 0], // CopyArea
            &[0; 24],
        ]
        .concat();
        let mut x = XStream::new(b'l');
        assert_eq!(x.client_sent(&stream), 6);
        for cut in [1, 3, 5, 7, 13] {
            let mut x = XStream::new(b'l');
            assert_eq!(stream.chunks(cut).map(|c| x.client_sent(c)).sum::<u32>(), 6, "in chunks of {cut}");
        }
    }

    #[test]
    fn extension_drawing_is_known_by_the_opcodes_the_server_gave() {
        let mut x = XStream::new(b'l');
        x.client_sent(&query_extension(b"RENDER")); // request 1
        x.client_sent(&query_extension(b"MIT-SHM")); // request 2
        x.client_sent(&query_extension(b"GLX")); // request 3: not present
        // The replies may come in any order relative to events, and the answer to GLX says absent.
        let mut absent = reply(3, 0);
        absent[8..12].copy_from_slice(&[0, 0, 0, 0]);
        x.server_sent(&server_stream(&[&SETUP_REPLY, &extension_reply(2, 130), &event(12), &extension_reply(1, 139), &absent]));
        // RENDER Composite (139/8, 9 units), FillRectangles (139/26, 5 units), CreatePicture (139/4, 5 units);
        // MIT-SHM PutImage (130/3, 10 units), Attach (130/1, 4 units).
        let stream: Vec<u8> = [
            &[139u8, 8, 9, 0][..],
            &[0; 32],
            &[139, 26, 5, 0],
            &[0; 16],
            &[139, 4, 5, 0],
            &[0; 16],
            &[130, 3, 10, 0],
            &[0; 36],
            &[130, 1, 4, 0],
            &[0; 12],
        ]
        .concat();
        assert_eq!(x.client_sent(&stream), 3);
    }

    #[test]
    fn frames_after_an_input_make_its_rate() {
        let mut i = XInteraction::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        i.frame(ms(1)); // before any input: put down to none
        i.input(ms(10), 2);
        // 4 frames, the last 200 ms after the input: 20 per second.
        for t in [60, 110, 160, 210] {
            i.frame(ms(t));
        }
        i.input(ms(500), 1);
        // 1 frame 10 ms after: 100 per second (the open episode counts).
        i.frame(ms(510));
        assert_eq!(i.averaged(ms(600), Duration::from_secs(1)), (3.0, Some(60.0)));
        // An input never answered adds to the count only.
        i.input(ms(700), 1);
        assert_eq!(i.averaged(ms(800), Duration::from_secs(1)), (4.0, Some(60.0)));
        // Later, everything is out of the window (and none is 0, not -0 as an empty f64 sum is).
        let (n, fps) = i.averaged(ms(5000), Duration::from_secs(1));
        assert_eq!((n.to_bits(), fps), (0.0f64.to_bits(), None));
    }
}
