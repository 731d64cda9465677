//! Device-buffer collectives (placeholder).
