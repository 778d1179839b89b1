"""Who sent a heartbeat: the user id from the monolith's JWT, or from a trusted gateway header.

Whatever a client sends, the answer is a user id or an AuthError (401): a token that breaks the
JWT library (a key of the wrong kind, an `exp` no clock can reach) is a bad token, not a 500.
During a rotation a token of a previous key is accepted and counted (AUTH_PREVIOUS_KEY); a token of
any other key is refused.
"""

import contextlib
import re
import time
from collections.abc import Callable

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from service.config import AuthSettings, ConfigError, Settings
from service.metrics import AUTH_PREVIOUS_KEY

_MAX_USER_ID = 2**63 - 1
# "1_0", " 11 ", "+9" and non-ASCII digits are what int() accepts and no issuer writes: only canonical ASCII digits
_CANONICAL_ID = re.compile(rb"[1-9][0-9]{0,18}")
# exp beyond the year 9999 is not a date; a float() of 10**400 would raise OverflowError
_MAX_EXP_S = 253_402_300_799
# The app repeats one token every 5 s: verify each once, then only re-check its expiry. Two generations:
# a flood of distinct tokens costs at most twice this many entries, and a token in use survives a turnover.
_VERIFIED_GENERATION_SIZE = 50_000
# JWT_PUBLIC_KEY may hold several keys during a rotation: concatenated PEM blocks, the current one first
_PEM_BLOCK = re.compile(r"-----BEGIN [A-Z ]+-----.+?-----END [A-Z ]+-----", re.DOTALL)
_ALGORITHM_KEY_KIND = {
    **{f"HS{bits}": "HMAC secret" for bits in (256, 384, 512)},
    **{f"{family}{bits}": "RSA public key" for family in ("RS", "PS") for bits in (256, 384, 512)},
    **{f"ES{bits}": "EC public key" for bits in (256, 384, 512)},
    "ES256K": "EC public key",
    "EdDSA": "EdDSA public key",
}


class AuthError(Exception):
    """The request does not prove a user; the message says why (it is sent back with the 401)."""


def parse_user_id(raw: object, source: str) -> int:
    """A JSON integer, or a string/bytes of canonical decimal digits, from 1 to 2^63-1; nothing else."""
    if isinstance(raw, bool):  # True is an int to Python, not a user to anyone
        raise AuthError(f"{source} is not a user id")
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "replace")
    if isinstance(raw, bytes):
        if _CANONICAL_ID.fullmatch(raw) is None:
            raise AuthError(f"{source} is not a positive integer user id")
        raw = int(raw)
    if not isinstance(raw, int) or not 1 <= raw <= _MAX_USER_ID:
        raise AuthError(f"{source} is not a positive integer user id")
    return raw


class Authenticator:
    def __init__(self, settings: AuthSettings, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # a cached token's expiry is checked against it (tests move it)
        self.gateway_header = settings.gateway_header.lower().encode("latin-1")
        self.use_gateway = settings.mode == "gateway"
        self._current_key, *self._previous_keys = verifying_keys(settings)
        self._algorithms = _listed(settings.algorithms)
        self._claim = settings.user_id_claim
        self._audience = settings.audience or None
        self._issuer = settings.issuer or None
        # token -> (user id, expiry, verified by a previous key)
        self._verified: dict[bytes, tuple[int, float, bool]] = {}
        self._verified_old: dict[bytes, tuple[int, float, bool]] = {}

    def user_id(self, authorization: bytes | None, gateway_value: bytes | None) -> int:
        if self.use_gateway:
            if gateway_value is None:
                raise AuthError("missing user header from the gateway")
            return parse_user_id(gateway_value, "gateway user header")
        if authorization is None:
            raise AuthError("missing Authorization header")
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise AuthError("Authorization header must be 'Bearer <token>'")
        token = token.strip()
        cached = self._verified.get(token)
        if cached is None:
            cached = self._verified_old.pop(token, None)
            if cached is None:
                return self._verify(token)
            self._remember(token, cached)
        user_id, expires_at, previous_key = cached
        if self._clock() < expires_at:
            if previous_key:  # counted on every request, not once per token: a cached token is still in use
                AUTH_PREVIOUS_KEY.inc()
            return user_id
        del self._verified[token]
        raise AuthError("token expired")

    def cached_tokens(self) -> int:
        return len(self._verified) + len(self._verified_old)

    def _remember(self, token: bytes, entry: tuple[int, float, bool]) -> None:
        if len(self._verified) >= _VERIFIED_GENERATION_SIZE:
            self._verified_old = self._verified
            self._verified = {}
        self._verified[token] = entry

    def _decode(self, token: bytes, key: str) -> dict[str, object]:
        claims: dict[str, object] = jwt.decode(
            token,
            key,
            algorithms=self._algorithms,
            audience=self._audience,
            issuer=self._issuer,
            # an `aud` is checked when JWT_AUDIENCE names one; without it, the monolith's tokens
            # may carry any (PyJWT would refuse every token that has one)
            options={"require": ["exp"], "verify_aud": self._audience is not None},
        )
        return claims

    def _claims(self, token: bytes) -> tuple[dict[str, object], bool]:
        """The token's claims, and whether a previous key verified them. A token of the current key costs one
        verification: only a signature the current key refuses is tried with each previous key."""
        try:
            return self._decode(token, self._current_key), False
        except jwt.InvalidSignatureError:
            for key in self._previous_keys:
                with contextlib.suppress(jwt.InvalidSignatureError):
                    return self._decode(token, key), True
            raise

    def _verify(self, token: bytes) -> int:
        try:
            claims, previous_key = self._claims(token)
        except jwt.ExpiredSignatureError:
            raise AuthError("token expired") from None
        except jwt.PyJWTError as exc:
            # InvalidKeyError (a header naming an algorithm of another key kind) is not an InvalidTokenError
            raise AuthError(f"invalid token: {exc}") from None
        except (OverflowError, ValueError) as exc:
            # PyJWT's int() of an `exp`/`nbf`/`iat` of 1e400 (inf) raises OverflowError, not its own error
            raise AuthError(f"invalid token: {exc}") from None
        if self._claim not in claims:
            raise AuthError(f"token has no '{self._claim}' claim")
        user_id = parse_user_id(claims[self._claim], f"token claim '{self._claim}'")
        exp = claims["exp"]  # PyJWT checked it is there and an integer in the past-or-future sense
        if isinstance(exp, bool) or not isinstance(exp, int | float) or not 0 <= exp <= _MAX_EXP_S:
            raise AuthError("invalid token: 'exp' is not a date")
        self._remember(token, (user_id, float(exp), previous_key))
        if previous_key:
            AUTH_PREVIOUS_KEY.inc()
        return user_id


def _listed(text: str) -> list[str]:
    """The entries of a comma-separated setting (JWT_ALGORITHMS, JWT_PREVIOUS_SECRETS)."""
    return [entry.strip() for entry in text.split(",") if entry.strip()]


def verifying_keys(settings: AuthSettings) -> list[str]:
    """What verifies a token, the current key first: each PEM block of JWT_PUBLIC_KEY, or JWT_SECRET and then
    JWT_PREVIOUS_SECRETS."""
    if settings.public_key:
        return _PEM_BLOCK.findall(settings.public_key) or [settings.public_key]
    return [settings.secret, *_listed(settings.previous_secrets)]


def check_keys(settings: AuthSettings) -> None:
    """Refuse at start-up the keys and algorithms that would answer every token 401, or trust a forged one."""
    if settings.mode != "jwt":
        return
    algorithms, previous_secrets = _listed(settings.algorithms), _listed(settings.previous_secrets)
    if not (settings.public_key or settings.secret):
        raise ConfigError(
            "AUTH_MODE=jwt needs a key: set JWT_SECRET (HS256, shared with the monolith) "
            "or JWT_PUBLIC_KEY with JWT_ALGORITHMS=RS256/ES256; "
            "or set AUTH_MODE=gateway behind a gateway that authenticates"
        )
    if not algorithms:  # PyJWT would refuse every token
        raise ConfigError("JWT_ALGORITHMS is empty: name the algorithm the tokens are signed with (HS256, RS256, ...)")
    if not settings.public_key and any(not a.startswith("HS") for a in algorithms):
        raise ConfigError(f"JWT_ALGORITHMS={settings.algorithms} needs JWT_PUBLIC_KEY (PEM)")
    # Every key verifies every token (JWT_PUBLIC_KEY with HS256 too): an algorithm of another key kind can only
    # fail (PyJWT's InvalidKeyError) or, worse, let HS256 use the public key as a shared secret.
    key_kinds = [_public_key_kind(pem) for pem in verifying_keys(settings)] if settings.public_key else ["HMAC secret"]
    for key_kind in key_kinds:
        for algorithm in algorithms:
            if _ALGORITHM_KEY_KIND.get(algorithm) != key_kind:
                raise ConfigError(
                    f"JWT_ALGORITHMS={settings.algorithms}: {algorithm} cannot be verified with the configured "
                    f"key ({key_kind}); list only algorithms of that key kind"
                )
    if settings.secret and not settings.public_key and len(settings.secret) < 32:
        raise ConfigError("JWT_SECRET is too short to be a real secret (at least 32 characters)")
    if previous_secrets and settings.public_key:
        raise ConfigError(
            "JWT_PREVIOUS_SECRETS are HS256 secrets: with JWT_PUBLIC_KEY, put the previous public keys "
            "in JWT_PUBLIC_KEY after the current one (concatenated PEM blocks)"
        )
    if any(len(secret) < 32 for secret in previous_secrets):
        raise ConfigError(
            "JWT_PREVIOUS_SECRETS holds a secret too short to be a real one (each at least 32 characters)"
        )


def _public_key_kind(pem: str) -> str:
    try:
        key = load_pem_public_key(pem.encode())
    except ValueError as exc:
        raise ConfigError(f"JWT_PUBLIC_KEY is not a PEM public key: {exc}") from None
    if isinstance(key, rsa.RSAPublicKey):
        return "RSA public key"
    if isinstance(key, ec.EllipticCurvePublicKey):
        return "EC public key"
    if isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return "EdDSA public key"
    return type(key).__name__


def make_token(settings: Settings, user_id: int, *, ttl_s: int = 30 * 24 * 3600) -> str:
    """A token as the monolith issues it (HS256 only): for `dev`, the tests and the benchmarks."""
    claims: dict[str, object] = {settings.jwt_user_id_claim: user_id, "exp": int(time.time()) + ttl_s}
    if settings.jwt_audience:
        claims["aud"] = settings.jwt_audience
    if settings.jwt_issuer:
        claims["iss"] = settings.jwt_issuer
    return jwt.encode(claims, settings.jwt_secret, algorithm="HS256")
