//! ferroccl-candle's test suite: the data-parallel trainer on real ranks.

mod trainer;
