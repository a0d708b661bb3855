//! Integration tests: each starts the real `relay` binary on an ephemeral loopback port and
//! talks real HTTP and WebSocket to it. Modules by theme; helpers in `support`.

mod support;

mod browser;
mod cluster;
mod dispatch;
mod docs_examples;
mod fair_cluster;
mod fairness;
mod files;
mod flow;
mod hostile;
mod http_protocol;
mod journal;
mod listing;
mod model_pg;
mod openapi;
mod ops;
mod pg_cluster;
mod regressions;
mod retries;
mod review;
mod sessions;
mod store;
mod tasks_api;
mod tokens;
mod websocket;
