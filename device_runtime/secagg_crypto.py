"""The key material of SecAgg+ from a maintained library (``cryptography``): X25519 key agreement, HKDF-SHA256
key derivation, AES-256-GCM for the shares one device sends another through the server, and ChaCha20 as the
pseudo-random generator that expands a 32-byte seed into a mask over Z_{2^b}.

Every key is fresh per round (``KeyPair.generate``: the OS's generator); a derived key is bound to its purpose, the
run and the round (HKDF's info), so one agreement never serves two rounds or two purposes.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

KEY_BYTES = 32
NONCE_BYTES = 12


@functools.cache
def _lib() -> SimpleNamespace:
    """``cryptography``'s primitives, imported at their first use: a device in a plain run never loads the library
    (about 7 MiB of resident memory that its measured tier floors do not hold)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
    return SimpleNamespace(**locals())


class CryptoError(ValueError):
    """A ciphertext that does not open under its key and context, or a malformed key."""


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair: the private key's 32 bytes and the public key's 32 bytes."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        c = _lib()
        key = c.X25519PrivateKey.generate()
        return cls.of_private(key.private_bytes(c.Encoding.Raw, c.PrivateFormat.Raw, c.NoEncryption()))

    @classmethod
    def of_private(cls, private: bytes) -> KeyPair:
        """The pair of a private key (a rebuilt one: the server recovers a dropped device's mask key)."""
        c = _lib()
        try:
            key = c.X25519PrivateKey.from_private_bytes(private)
        except ValueError as exc:
            raise CryptoError(f"not an X25519 private key: {exc}") from None
        return cls(private, key.public_key().public_bytes(c.Encoding.Raw, c.PublicFormat.Raw))


def agree(private: bytes, peer_public: bytes, purpose: str, context: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 over the X25519 shared secret, bound to ``purpose`` and
    ``context`` (the run and round)."""
    c = _lib()
    try:
        peer = c.X25519PublicKey.from_public_bytes(peer_public)
        shared = c.X25519PrivateKey.from_private_bytes(private).exchange(peer)
    except ValueError as exc:
        raise CryptoError(f"key agreement failed: {exc}") from None
    return c.HKDF(algorithm=c.hashes.SHA256(), length=KEY_BYTES, salt=None,
                  info=b"fedara-secagg/" + purpose.encode() + b"/" + context).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM: a fresh random nonce, then the ciphertext and its tag; ``associated`` is authenticated."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + _lib().AESGCM(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of ``seal``; CryptoError when the key, the context or a byte differs."""
    if len(sealed) < NONCE_BYTES + 16:
        raise CryptoError(f"a sealed share is at least {NONCE_BYTES + 16} bytes, got {len(sealed)}")
    c = _lib()
    try:
        return c.AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except c.InvalidTag:
        raise CryptoError("the share does not open: another key, another context, or altered bytes") from None


class MaskStream:
    """Pseudo-random values in Z_{2^bits} (uint64): ChaCha20's keystream under a 32-byte seed (nonce 0: a seed
    serves one mask), 8 bytes a value, reduced to ``bits``; taken in pieces, so a long mask needs no whole copy."""

    def __init__(self, seed: bytes, bits: int):
        if len(seed) != KEY_BYTES:
            raise CryptoError(f"a mask seed is {KEY_BYTES} bytes, got {len(seed)}")
        if not 1 <= bits <= 64:
            raise CryptoError(f"masks live in Z_(2^b) with 1 <= b <= 64, got b = {bits}")
        c = _lib()
        self._stream = c.Cipher(c.algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
        self._reduce = None if bits == 64 else np.uint64((1 << bits) - 1)

    def take(self, size: int) -> np.ndarray:
        """The next ``size`` values."""
        values = np.frombuffer(self._stream.update(bytes(8 * size)), dtype="<u8").astype(np.uint64)
        return values if self._reduce is None else values & self._reduce


def mask(seed: bytes, size: int, bits: int) -> np.ndarray:
    """The first ``size`` values of ``MaskStream(seed, bits)``."""
    return MaskStream(seed, bits).take(size)


def random_seed() -> bytes:
    """A fresh 32-byte seed (the self mask's) from the OS's generator."""
    return os.urandom(KEY_BYTES)
