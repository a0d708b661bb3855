//! `GET /tasks` (SPEC §4 "Listing") against the real server: order, paging with an opaque
//! cursor while tasks arrive, filters, bad values, the check order.

use serde_json::Value;

use crate::support::*;

fn queued(relay: &Relay, kind: &str) -> String {
    let r = relay.submit(&format!(r#"{{"payload":{{"kind":"{kind}"}},"queue":true}}"#));
    assert_eq!(r.status, 202, "{}", r.text());
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

/// (task ids, next_cursor) of one page.
fn page(relay: &Relay, query: &str) -> (Vec<String>, Option<String>) {
    let r = relay.api("GET", &format!("/tasks{query}"), None);
    assert_eq!(r.status, 200, "GET /tasks{query}: {}", r.text());
    assert_eq!(r.header("Content-Type"), Some("application/json"));
    let v: Value = r.json();
    let ids =
        v["tasks"].as_array().expect("tasks array").iter().map(|t| t["task_id"].as_str().expect("id").to_string());
    (ids.collect(), v["next_cursor"].as_str().map(str::to_string))
}

#[test]
fn pages_newest_first_and_a_cursor_survives_new_tasks() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let ids: Vec<String> = (0..5).map(|i| queued(&relay, if i % 2 == 0 { "even" } else { "odd" })).collect();
        let (p1, c1) = page(&relay, "?limit=2");
        assert_eq!(p1, [ids[4].clone(), ids[3].clone()]);
        // Tasks that arrive now do not shift the pages that follow.
        let later = queued(&relay, "even");
        let (p2, c2) = page(&relay, &format!("?limit=2&cursor={}", c1.expect("cursor")));
        assert_eq!(p2, [ids[2].clone(), ids[1].clone()]);
        let (p3, c3) = page(&relay, &format!("?limit=2&cursor={}", c2.expect("cursor")));
        assert_eq!((p3, c3), (vec![ids[0].clone()], None), "the last page has no next_cursor");
        let (all, none) = page(&relay, "");
        assert_eq!((all.len(), all[0].clone(), none), (6, later, None));

        // Filters, and the task JSON is the same as GET /tasks/{id}.
        let (even, _) = page(&relay, "?kind=even&status=pending");
        assert_eq!(even.len(), 4);
        let r = relay.api("GET", "/tasks?kind=odd&limit=1", None).json();
        assert_eq!(r["tasks"][0], relay.get_task(&ids[3]));
        let canceled = relay.api("DELETE", &format!("/tasks/{}", ids[1]), None);
        assert_eq!(canceled.status, 200);
        assert_eq!(page(&relay, "?status=canceled").0, [ids[1].clone()]);
        assert_eq!(page(&relay, "?status=done").0, Vec::<String>::new());
    });
}

#[test]
fn bad_values_are_400_and_auth_comes_first() {
    for_each_mode(|mode| {
        let relay = mode.start();
        for query in [
            "?status=running",
            "?status=",
            "?limit=0",
            "?limit=1001",
            "?limit=ten",
            "?cursor=nope",
            "?cursor=AAAAAAAAAAAA",
            "?status=done&status=failed",
        ] {
            let r = relay.api("GET", &format!("/tasks{query}"), None);
            assert_eq!((r.status, r.error().as_str()), (400, "bad_request"), "{query}: {}", r.text());
            assert!(r.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
        assert_eq!(relay.api("GET", "/tasks?limit=1000", None).status, 200);
        // 401 before the query is looked at.
        let r = request(relay.addr, "GET", "/tasks?status=running", &[], None);
        assert_eq!(r.status, 401);
        let r = request(relay.addr, "PUT", "/tasks", &[], None);
        assert_eq!((r.status, r.header("Allow")), (405, Some("GET, HEAD, POST")));
    });
}

#[test]
fn head_lists_nothing_but_the_headers() {
    for_each_mode(|mode| {
        let relay = mode.start();
        queued(&relay, "k");
        let mut c = Client::connect(relay.addr);
        let auth = format!("Bearer {API}");
        c.send("HEAD", "/tasks", &[("Authorization", auth.as_str())], None);
        let r = c.read_response_to(true).expect("answer");
        assert_eq!(r.status, 200);
        assert!(r.body.is_empty());
        assert!(r.header("Content-Length").is_some_and(|n| n != "0"));
    });
}
