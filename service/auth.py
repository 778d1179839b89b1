"""Who sent a heartbeat: the user id from the monolith's JWT, or from a trusted gateway header."""

import time

import jwt

from service.config import Settings

_MAX_USER_ID = 2**63 - 1
# The app repeats one token every 5 s for its whole lifetime: verify each token once, then
# only re-check its expiry. Bounded so a flood of distinct tokens cannot grow memory.
_VERIFIED_CACHE_SIZE = 100_000


class AuthError(Exception):
    """The request does not prove a user; the message says why (it is sent back with the 401)."""


def _as_user_id(raw: object, source: str) -> int:
    if isinstance(raw, bool):
        raise AuthError(f"{source} is not a user id")
    try:
        user_id = int(raw) if isinstance(raw, int | str) else 0
    except ValueError:
        user_id = 0
    if not 1 <= user_id <= _MAX_USER_ID:
        raise AuthError(f"{source} is not a positive integer user id")
    return user_id


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self.gateway_header = settings.auth_gateway_header.lower().encode("latin-1")
        self.use_gateway = settings.auth_mode == "gateway"
        self._key = settings.jwt_key
        self._algorithms = settings.jwt_algorithm_list
        self._claim = settings.jwt_user_id_claim
        self._audience = settings.jwt_audience or None
        self._issuer = settings.jwt_issuer or None
        self._verified: dict[bytes, tuple[int, float]] = {}

    def user_id(self, authorization: bytes | None, gateway_value: bytes | None) -> int:
        if self.use_gateway:
            if gateway_value is None:
                raise AuthError("missing user header from the gateway")
            return _as_user_id(gateway_value.decode("latin-1").strip(), "gateway user header")
        if authorization is None:
            raise AuthError("missing Authorization header")
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise AuthError("Authorization header must be 'Bearer <token>'")
        token = token.strip()
        cached = self._verified.get(token)
        if cached is not None:
            user_id, expires_at = cached
            if time.time() < expires_at:
                return user_id
            del self._verified[token]
            raise AuthError("token expired")
        return self._verify(token)

    def _verify(self, token: bytes) -> int:
        try:
            claims = jwt.decode(
                token, self._key, algorithms=self._algorithms, audience=self._audience,
                issuer=self._issuer, options={"require": ["exp"]},
            )  # fmt: skip
        except jwt.ExpiredSignatureError:
            raise AuthError("token expired") from None
        except jwt.InvalidTokenError as exc:
            raise AuthError(f"invalid token: {exc}") from None
        if self._claim not in claims:
            raise AuthError(f"token has no '{self._claim}' claim")
        user_id = _as_user_id(claims[self._claim], f"token claim '{self._claim}'")
        if len(self._verified) >= _VERIFIED_CACHE_SIZE:
            self._verified.clear()
        self._verified[token] = (user_id, float(claims["exp"]))
        return user_id


def make_token(settings: Settings, user_id: int, *, ttl_s: int = 30 * 24 * 3600) -> str:
    """A token as the monolith issues it (HS256 only): for `dev`, the tests and the benchmarks."""
    claims: dict[str, object] = {settings.jwt_user_id_claim: user_id, "exp": int(time.time()) + ttl_s}
    if settings.jwt_audience:
        claims["aud"] = settings.jwt_audience
    if settings.jwt_issuer:
        claims["iss"] = settings.jwt_issuer
    return jwt.encode(claims, settings.jwt_secret, algorithm="HS256")
