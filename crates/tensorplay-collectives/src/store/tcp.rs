//! The TCP store (`TCPStore`): a server thread and clients. (Being written.)
