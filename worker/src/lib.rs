//! relay-worker library (skeleton; filled by the worker issue).
