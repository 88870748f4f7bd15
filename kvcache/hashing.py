"""Page hashes: the identity of a page of KV across requests, tiers and workers.

    h(page i) = blake2b-128(h(page i-1) || model fingerprint || tenant salt || token ids of page i)

Chaining makes a page's hash stand for its whole prefix, so two requests share page i only if
every token before it is the same too. The tenant salt keeps one tenant's pages invisible to
another in every tier (and in the cluster index, which only ever sees hashes). Only full pages
are hashed: a partial last page is always recomputed.

A request may add a salt of its own (`cache_salt`, as vLLM's): the salt is then the tenant's
name, SALT_SEPARATOR and the request's salt, so only the tenant's requests with the same salt
share those pages, and purging the tenant still finds them (`tenant_of`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import AnyStr

import numpy as np

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)
# Between a tenant's name and a request's own salt. Tenant names never hold it: they are
# whitespace-free words, and str.split() counts the unit separator as whitespace.
SALT_SEPARATOR = "\x1f"


def cache_salt(tenant: str, request_salt: str | None) -> str:
    """The salt of a request's pages: its tenant's, narrowed by its own salt when it gave one."""
    return tenant if request_salt is None else f"{tenant}{SALT_SEPARATOR}{request_salt}"


def tenant_of(salt: AnyStr) -> AnyStr:
    """The tenant a salt belongs to (its own salt, or one a request narrowed), as a Job (str)
    or the cache (bytes) holds it."""
    separator = SALT_SEPARATOR if isinstance(salt, str) else SALT_SEPARATOR.encode()
    return salt.partition(separator)[0]


def page_hash(parent: bytes, token_ids: Sequence[int], salt: bytes, fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent)
    h.update(fingerprint)
    h.update(len(salt).to_bytes(2, "little"))  # length-prefixed: salt and tokens cannot blur
    h.update(salt)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return h.digest()


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    salt: bytes,
    fingerprint: bytes,
    parent: bytes = ROOT_HASH,
    start_page: int = 0,
) -> list[bytes]:
    """Hashes of the full pages of `token_ids` from page `start_page` on, chained from `parent`."""
    out = []
    for i in range(start_page, len(token_ids) // page_size):
        parent = page_hash(parent, token_ids[i * page_size : (i + 1) * page_size], salt, fingerprint)
        out.append(parent)
    return out


def model_fingerprint(*parts: str) -> bytes:
    """A model's identity for page hashes: anything that changes the KV of a token must be in it."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=HASH_BYTES).digest()
