//! TCP transport (mio + socket2).
