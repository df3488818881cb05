//! The call protocol's words in the state block and the error word: where each lives,
//! and how a call header is encoded. The kernels read all of it from
//! [`crate::kernel_defines`] (`ARF_STATE_*`, `ARF_ERR_*`, `ARF_HDR_*`).
//!
//! State block of every rank (u32 words, [`crate::STATE_BYTES`] bytes):
//!
//! | words | what |
//! |---|---|
//! | [`STATE_WORD_CALL`] | call counter n of this rank (its sequence number) |
//! | [`STATE_WORD_ARRIVALS`] | CTAs of this rank that finished call n |
//! | [`STATE_WORD_USED`] .. + 3 | bytes the last call that used Lamport buffer i wrote into it |
//! | [`STATE_WORD_ABORT`] | set by any rank that gave up, in every peer: [`abort_word`] |
//! | [`STATE_WORD_HEADERS`] .. + 2 * [`crate::MAX_RANKS`] | call headers: rank q's header of call n at `HEADERS + (n % 2) * MAX_RANKS + q` |
//!
//! A call header says which call a rank is in ([`call_header`]): the low byte of its
//! sequence number plus one, the low 16 bits of its T and the low byte of the caller's
//! call tag (the fused site). Every rank writes its header into every peer before its
//! data and checks the W headers of its call before it returns: ranks that disagree on
//! T or on the call (a rank that skipped one, or called another site) stop with
//! [`ERR_CALL_MISMATCH`] instead of summing another call's data. Two header slots per
//! rank suffice: no rank is ever more than one call ahead of another (a rank finishes
//! call n only after every rank pushed its data for call n).

use crate::{LAMPORT_BUFFER_COUNT, MAX_RANKS, STATE_BYTES};

/// State word: the call counter.
pub const STATE_WORD_CALL: u64 = 0;
/// State word: the CTA arrival count.
pub const STATE_WORD_ARRIVALS: u64 = 1;
/// First state word of the bytes used per Lamport buffer ([`LAMPORT_BUFFER_COUNT`] words).
pub const STATE_WORD_USED: u64 = 2;
/// State word: the abort word, which any rank that gives up writes into every peer.
pub const STATE_WORD_ABORT: u64 = STATE_WORD_USED + LAMPORT_BUFFER_COUNT;
/// First state word of the call headers (2 * [`MAX_RANKS`] words).
pub const STATE_WORD_HEADERS: u64 = 8;

/// Error word bit: a one-shot call gave up waiting for a peer.
pub const ERR_ONESHOT_TIMEOUT: u32 = 1;
/// Error word bit: a two-shot call gave up waiting for a peer.
pub const ERR_TWOSHOT_TIMEOUT: u32 = 2;
/// Error word bit: the ranks' call headers disagree (T, call tag or sequence).
pub const ERR_CALL_MISMATCH: u32 = 4;
/// Error word bit: a peer gave up and aborted this call.
pub const ERR_PEER_ABORT: u32 = 8;

/// Bit position of the rank (plus one) in an abort word; the low bits hold the error
/// word bits of the rank that gave up ([`abort_word`]).
pub const ABORT_RANK_SHIFT: u32 = 8;

/// The abort word rank `rank` writes into every peer when it gives up with `code`.
pub const fn abort_word(code: u32, rank: u32) -> u32 {
    code | (rank + 1) << ABORT_RANK_SHIFT
}

/// The rank an abort word names and its error bits (`None` for 0: no abort).
pub const fn abort_word_parts(word: u32) -> Option<(u32, u32)> {
    match word >> ABORT_RANK_SHIFT {
        0 => None,
        r => Some((r - 1, word & ((1 << ABORT_RANK_SHIFT) - 1))),
    }
}

/// Bit position of the sequence byte in a call header.
pub const HEADER_SEQ_SHIFT: u32 = 24;
/// Bit position of T's low 16 bits in a call header.
pub const HEADER_TOKENS_SHIFT: u32 = 8;

/// The header of call `seq` (the rank's call counter) with `tokens` tokens and caller
/// tag `tag`: `((seq + 1) mod 256) << 24 | (tokens mod 65536) << 8 | (tag mod 256)`.
/// Never equal to the header a slot held two calls earlier (the sequence byte differs),
/// nor to a fresh slot's 0 for the call that first uses it (n = 0 or 1).
pub const fn call_header(seq: u32, tokens: u32, tag: u32) -> u32 {
    (seq.wrapping_add(1) & 0xff) << HEADER_SEQ_SHIFT
        | (tokens & 0xffff) << HEADER_TOKENS_SHIFT
        | (tag & 0xff)
}

/// What an error word says, in words (the bits above; unknown bits by value).
pub fn describe_error_word(word: u32) -> String {
    let mut parts = Vec::new();
    for (bit, what) in [
        (ERR_ONESHOT_TIMEOUT, "one-shot timeout waiting for a peer"),
        (ERR_TWOSHOT_TIMEOUT, "two-shot timeout waiting for a peer"),
        (
            ERR_CALL_MISMATCH,
            "ranks disagree on the call (T, call tag or sequence)",
        ),
        (ERR_PEER_ABORT, "a peer aborted the call"),
    ] {
        if word & bit != 0 {
            parts.push(what.to_string());
        }
    }
    let rest =
        word & !(ERR_ONESHOT_TIMEOUT | ERR_TWOSHOT_TIMEOUT | ERR_CALL_MISMATCH | ERR_PEER_ABORT);
    if rest != 0 {
        parts.push(format!("unknown bits {rest:#x}"));
    }
    parts.join("; ")
}

const _: () = assert!(STATE_WORD_ABORT < STATE_WORD_HEADERS);
const _: () = assert!((STATE_WORD_HEADERS + 2 * MAX_RANKS as u64) * 4 <= STATE_BYTES);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_change_with_every_field_and_never_repeat_two_calls_apart() {
        let h = call_header(6, 300, 2);
        assert_eq!(h, 7 << 24 | 300 << 8 | 2);
        assert_ne!(h, call_header(6, 301, 2));
        assert_ne!(h, call_header(6, 300, 3));
        assert_ne!(h, call_header(5, 300, 2));
        for seq in 0..1024u32 {
            assert_ne!(
                call_header(seq, 1, 0),
                call_header(seq.wrapping_sub(2), 1, 0)
            );
        }
        // A slot is fresh (0) only for the first call of its parity (n = 0, 1).
        assert!(call_header(0, 0, 0) != 0 && call_header(1, 0, 0) != 0);
        assert_eq!(call_header(u32::MAX, 1, 1), 1 << 8 | 1);
    }

    #[test]
    fn abort_words_name_the_rank_and_the_code() {
        assert_eq!(abort_word(ERR_CALL_MISMATCH, 0), 0x104);
        assert_eq!(
            abort_word_parts(abort_word(ERR_ONESHOT_TIMEOUT, 15)),
            Some((15, 1))
        );
        assert_eq!(abort_word_parts(0), None);
    }

    #[test]
    fn error_words_are_described() {
        assert_eq!(
            describe_error_word(ERR_CALL_MISMATCH | ERR_PEER_ABORT),
            "ranks disagree on the call (T, call tag or sequence); a peer aborted the call"
        );
        assert_eq!(describe_error_word(0x40), "unknown bits 0x40");
    }
}
