"""A Python producer as the BabelQueue Python SDK makes one with field encryption.

Reads one JSON request on standard input:

    {"key": "<AES key, hex>", "urn": "...", "id": "<meta.id>", "queue": "...",
     "paths": ["card.number", "items[].note", ...],
     "sends": [{"data": {...}, "count": 3}, ...]}

and prints, for each send in turn, `count` envelopes of its data, one a line,
each a fresh encryption of the same cleartext under the same meta.id: a
producer retrying one message.

What it does is the SDK's wire, written here from its documented contract
(the SDK itself is not installable on the test machines):

- the SDK's `babelqueue.gdpr.protect`: each value at a sensitive path (an
  object key, `name[]` descending into every element of an array) is encoded
  as `json.dumps(value, sort_keys=True, separators=(",", ":"))` (so non-ASCII
  is escaped, unlike Go's encoding) and replaced in place by the cipher's
  string; an absent path is skipped;
- the cipher the SDK's documentation gives for AES-GCM (its core ships none):
  `cryptography`'s AESGCM, a random 12-byte nonce per call prepended to the
  sealed bytes, the whole base64 (standard alphabet, padded);
- the SDK's `EnvelopeCodec.make` and `encode`: job, trace_id, data, meta (id,
  queue, lang "python", schema_version 1, created_at in ms), attempts 0,
  written as compact JSON with `ensure_ascii=False`.
"""

import base64
import json
import os
import sys
import time
import uuid

from cryptography.hazmat.primitives.ciphers.aead import AESGCM


class AesGcmCipher:
    """AES-GCM with a random 12-byte nonce prepended, base64 out."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def encrypt(self, plaintext: bytes) -> str:
        nonce = os.urandom(12)
        return base64.b64encode(nonce + self._aead.encrypt(nonce, plaintext, None)).decode("ascii")


def parse_path(path):
    segments = []
    for part in path.split("."):
        if len(part) >= 2 and part.endswith("[]"):
            segments.append((part[:-2], True))
        else:
            segments.append((part, False))
    return segments


def encrypt_value(value, cipher):
    return cipher.encrypt(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def protect_at(node, segments, cipher):
    if not segments or not isinstance(node, dict):
        return
    key, is_array = segments[0]
    if key not in node:
        return
    last = len(segments) == 1
    child = node[key]
    if is_array:
        if not isinstance(child, list):
            return
        for i, element in enumerate(child):
            if last:
                child[i] = encrypt_value(element, cipher)
            else:
                protect_at(element, segments[1:], cipher)
        return
    if last:
        node[key] = encrypt_value(child, cipher)
        return
    protect_at(child, segments[1:], cipher)


def main() -> None:
    request = json.load(sys.stdin)
    cipher = AesGcmCipher(bytes.fromhex(request["key"]))
    for send in request["sends"]:
        for _ in range(send["count"]):
            print(json.dumps(envelope(request, send["data"], cipher), ensure_ascii=False, separators=(",", ":")))


def envelope(request, cleartext, cipher):
    data = json.loads(json.dumps(cleartext))  # a fresh copy: protect works in place
    for path in request["paths"]:
        if path:
            protect_at(data, parse_path(path), cipher)
    return {
        "job": request["urn"],
        "trace_id": str(uuid.uuid4()),
        "data": data,
        "meta": {
            "id": request["id"],
            "queue": request["queue"],
            "lang": "python",
            "schema_version": 1,
            "created_at": int(time.time() * 1000),
        },
        "attempts": 0,
    }


if __name__ == "__main__":
    main()
