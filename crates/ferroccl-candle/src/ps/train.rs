//! The trainer behind `ferroccl train --mode ssp`: LeNet on the digits over the
//! parameter server.
