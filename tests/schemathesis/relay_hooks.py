"""schemathesis hooks for tests/it/openapi.rs (loaded through SCHEMATHESIS_HOOKS).

An `Idempotency-Key` that repeats one an earlier request used is answered for that earlier task
*before the body is read* (SPEC §4): a repeat with a broken body is a 202 by contract. Generated
keys are short and repeat often, so such a repeat would look like "invalid data accepted". Every
valid key is made unique here, so each request is judged on its own; keys that are invalid on
purpose (empty, or over 256 bytes) are left exactly as generated.
"""
import uuid

import schemathesis

HEADER = "idempotency-key"
MAX_KEY_BYTES = 256
SUFFIX_BYTES = 33  # "-" + 32 hex digits


@schemathesis.hook
def before_call(context, case, **kwargs):
    headers = case.headers
    if not headers:
        return
    for name in list(headers):
        if name.lower() != HEADER:
            continue
        key = headers[name]
        if isinstance(key, str) and 0 < len(key.encode()) <= MAX_KEY_BYTES - SUFFIX_BYTES:
            headers[name] = key + "-" + uuid.uuid4().hex
