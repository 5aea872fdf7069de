//! Text from outside anyccl (a peer's message, a file, a vendor library's error string) made safe to show.
//!
//! Such text may carry terminal escape sequences (which can recolour, clear or retitle the user's terminal, or hide
//! what comes after them), newlines (which forge extra log lines), bidirectional-override characters (which make text
//! read differently from what it is) or simply megabytes. [`sanitize`] escapes every one of those characters and
//! bounds the length, so the result can go into an error message or a log line as is:
//!
//! ```
//! use anyccl_core::text::sanitize;
//! assert_eq!(sanitize("\u{1b}[2Jrank 3 failed\nINFO: all good"), "\\u{1b}[2Jrank 3 failed\\nINFO: all good");
//! assert_eq!(sanitize("plain text stays as it is"), "plain text stays as it is");
//! ```

/// How many bytes [`sanitize`] keeps, by default (before the note of what was cut).
pub const DEFAULT_MAX_LEN: usize = 1024;

/// The longest note [`sanitize_with_limit`] appends when it cuts text: `"…[+N bytes]"` with N up to 20 digits.
pub const CUT_NOTE_MAX_LEN: usize = "…[+ bytes]".len() + 20;

/// `text` with every control character escaped (`\n`, `\r`, `\t`, else `\u{..}`), bidirectional-override and line
/// separator characters escaped the same way, and at most [`DEFAULT_MAX_LEN`] bytes kept; see
/// [`sanitize_with_limit`].
pub fn sanitize(text: &str) -> String {
    sanitize_with_limit(text, DEFAULT_MAX_LEN)
}

/// Like [`sanitize`], keeping at most `max_len` bytes of the escaped text (cut at a character boundary, never inside
/// an escape); when anything was cut, a note `"…[+N bytes]"` follows, N being the input bytes not shown. The result
/// is therefore at most `max_len + CUT_NOTE_MAX_LEN` bytes long, contains no character that [`needs_escape`] flags,
/// and equals `text` when `text` has no such character and fits.
pub fn sanitize_with_limit(text: &str, max_len: usize) -> String {
    sanitize_chars(text.chars().map(|c| (c, c.len_utf8())), text.len(), max_len)
}

/// [`sanitize_with_limit`] for raw bytes (a payload that should be text): each invalid UTF-8 sequence becomes one
/// U+FFFD. Decoding stops where the output is full, so a huge input costs no more than a short one.
pub fn sanitize_bytes(bytes: &[u8], max_len: usize) -> String {
    let chars = bytes.utf8_chunks().flat_map(|chunk| {
        let invalid = chunk.invalid().len();
        let replacement = (invalid > 0).then_some(('\u{fffd}', invalid));
        chunk.valid().chars().map(|c| (c, c.len_utf8())).chain(replacement)
    });
    sanitize_chars(chars, bytes.len(), max_len)
}

/// The shared loop: `chars` yields each character with the number of input bytes it stands for; `total` is the
/// input's length.
fn sanitize_chars(chars: impl Iterator<Item = (char, usize)>, total: usize, max_len: usize) -> String {
    let mut out = String::with_capacity(total.min(max_len));
    let mut consumed = 0usize;
    let mut utf8 = [0u8; 4];
    for (c, input_len) in chars {
        let escaped;
        let piece: &str = if needs_escape(c) {
            escaped = escape(c);
            &escaped
        } else {
            c.encode_utf8(&mut utf8)
        };
        if out.len().saturating_add(piece.len()) > max_len {
            out.push_str(&format!("…[+{} bytes]", total.saturating_sub(consumed)));
            return out;
        }
        out.push_str(piece);
        consumed = consumed.saturating_add(input_len);
    }
    out
}

/// Whether [`sanitize`] escapes `c`: control characters (C0, DEL, C1), the bidirectional formatting characters
/// (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069) and the line and paragraph separators (U+2028, U+2029).
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        || matches!(c, '\u{2028}' | '\u{2029}')
}

/// The escape of a character that [`needs_escape`] flags.
fn escape(c: char) -> String {
    match c {
        '\n' => "\\n".to_owned(),
        '\r' => "\\r".to_owned(),
        '\t' => "\\t".to_owned(),
        c => format!("\\u{{{:x}}}", u32::from(c)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_terminal_sequences_and_newlines() {
        assert_eq!(sanitize("a\u{1b}[31mred\u{1b}[0m\r\n\tb\u{7}"), "a\\u{1b}[31mred\\u{1b}[0m\\r\\n\\tb\\u{7}");
        assert_eq!(sanitize("\u{9b}31m"), "\\u{9b}31m", "C1 CSI");
        assert_eq!(sanitize("\u{7f}"), "\\u{7f}");
        assert_eq!(sanitize("x\u{202e}txt.exe"), "x\\u{202e}txt.exe");
        assert_eq!(sanitize("a\u{2028}b"), "a\\u{2028}b");
    }

    #[test]
    fn keeps_ordinary_text() {
        for s in ["", "rank 3 failed: CUDA error 700", "ünïcödé ✓ 日本語", "C:\\path\\to", "\"quoted\" 'x'"] {
            assert_eq!(sanitize(s), s);
        }
    }

    #[test]
    fn bounds_the_length_and_says_what_was_cut() {
        let long = "x".repeat(5000);
        let s = sanitize(&long);
        assert_eq!(s, format!("{}…[+3976 bytes]", "x".repeat(1024)));
        // an escape is never split
        let s = sanitize_with_limit("ab\ncd", 3);
        assert_eq!(s, "ab…[+3 bytes]");
        // nor a multi-byte character
        let s = sanitize_with_limit("aé", 2);
        assert_eq!(s, "a…[+2 bytes]");
        assert_eq!(sanitize_with_limit("abc", 0), "…[+3 bytes]");
    }

    #[test]
    fn bytes_are_decoded_lossily_and_bounded() {
        assert_eq!(sanitize_bytes(b"ok\xff\x1b", 64), "ok\u{fffd}\\u{1b}");
        // one replacement character per invalid sequence, counted as the bytes it replaced
        assert_eq!(sanitize_bytes(b"\xff\xfe\xfdabc", 3), "\u{fffd}…[+5 bytes]");
        let huge = vec![b'y'; 10 << 20];
        assert_eq!(sanitize_bytes(&huge, 8), format!("{}…[+{} bytes]", "y".repeat(8), (10 << 20) - 8));
        assert_eq!(sanitize_bytes(b"12345678", 8), "12345678");
        assert_eq!(sanitize_bytes(b"123456789", 8), "12345678…[+1 bytes]");
        assert_eq!(sanitize_bytes(b"\n\n\n\n\n\n\n\n\n\n\n\n\n\n", 4), "\\n\\n…[+12 bytes]");
    }

    fn clean(s: &str) -> bool {
        !s.chars().any(needs_escape)
    }

    proptest! {
        #[test]
        fn output_is_clean_and_bounded(s in any::<String>(), max in 0usize..64) {
            let out = sanitize_with_limit(&s, max);
            prop_assert!(clean(&out), "{out:?}");
            prop_assert!(out.len() <= max + CUT_NOTE_MAX_LEN, "{} > {max}", out.len());
        }

        #[test]
        fn clean_short_text_is_unchanged(s in "[^\\p{Cc}\u{061c}\u{200e}\u{200f}\u{202a}-\u{202e}\u{2066}-\u{2069}\u{2028}\u{2029}]{0,40}") {
            prop_assert_eq!(sanitize(&s), s);
        }

        #[test]
        fn sanitizing_twice_changes_nothing_more(s in any::<String>()) {
            let once = sanitize_with_limit(&s, 1 << 20);
            prop_assert_eq!(sanitize_with_limit(&once, 1 << 20), once.clone());
        }

        #[test]
        fn any_bytes_come_out_clean_and_bounded(b in proptest::collection::vec(any::<u8>(), 0..300), max in 0usize..64) {
            let out = sanitize_bytes(&b, max);
            prop_assert!(clean(&out), "{out:?}");
            prop_assert!(out.len() <= max + CUT_NOTE_MAX_LEN, "{} > {max}", out.len());
        }

        #[test]
        fn nothing_is_lost_silently(s in any::<String>(), max in 0usize..64) {
            // either everything is shown, or a note says how much was cut
            let out = sanitize_with_limit(&s, max);
            let cut = out.ends_with(" bytes]") && out.contains("…[+");
            prop_assert!(cut || out == sanitize_with_limit(&s, usize::MAX));
        }
    }
}
