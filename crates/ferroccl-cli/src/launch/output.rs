//! The ranks' output, forwarded line by line with a `[rank] ` prefix.

use super::*;

#[derive(Clone, Copy, Debug)]
pub(super) enum Stream {
    Stdout,
    Stderr,
}

/// Shared state of the output forwarders, watched by [`Job::reap_and_drain`].
#[derive(Default)]
pub(super) struct Forwarding {
    /// Forwarders not yet at end of output.
    pub(super) live: AtomicUsize,
    /// Forwarders inside a write to our stdout/stderr (a slow reader is not a hang).
    pub(super) writing: AtomicUsize,
    /// Lines read so far, all ranks together.
    pub(super) progress: AtomicU64,
    /// The rank whose stdout lines get no prefix.
    pub(super) bare_stdout_rank: Option<usize>,
    /// Each rank's last non-empty stderr line.
    pub(super) last_words: Mutex<std::collections::BTreeMap<usize, String>>,
}

/// Held while writing a line to stdout or stderr, so that lines of different ranks (and of
/// stdout and stderr sharing a terminal) never interleave.
pub(super) static OUTPUT: Mutex<()> = Mutex::new(());

pub(crate) fn lock_output() -> std::sync::MutexGuard<'static, ()> {
    OUTPUT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Copies `pipe` to our `stream` line by line with a `[rank] ` prefix. Bytes pass
/// through as they are; a last line without a newline gets one. If our own output is
/// closed the pipe is still drained, so the rank never blocks on a full pipe.
pub(super) fn forward_lines(rank: usize, pipe: impl Read, stream: Stream, fwd: &Forwarding) {
    let bare = matches!(stream, Stream::Stdout) && fwd.bare_stdout_rank == Some(rank);
    let prefix = if bare {
        String::new()
    } else {
        format!("[{rank}] ")
    };
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut line: Vec<u8> = Vec::new();
    let mut output_ok = true;
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        fwd.progress.fetch_add(1, Ordering::SeqCst);
        if matches!(stream, Stream::Stderr) {
            let words = String::from_utf8_lossy(&line[prefix.len()..]);
            let words = words.trim();
            if !words.is_empty() {
                fwd.last_words
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(rank, words.to_string());
            }
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if output_ok {
            fwd.writing.fetch_add(1, Ordering::SeqCst);
            output_ok = write_line(stream, &line).is_ok();
            fwd.writing.fetch_sub(1, Ordering::SeqCst);
        }
    }
    fwd.live.fetch_sub(1, Ordering::SeqCst);
}

pub(super) fn write_line(stream: Stream, line: &[u8]) -> io::Result<()> {
    let _guard = lock_output();
    match stream {
        Stream::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(line)?;
            out.flush()
        }
        Stream::Stderr => {
            let mut err = io::stderr().lock();
            err.write_all(line)?;
            err.flush()
        }
    }
}
