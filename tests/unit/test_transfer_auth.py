"""The transfer plane's descriptor authentication (issue #42, item 5): only descriptors the control plane signed
with the deployment's secret, unaltered and unexpired, verify; everything else is a typed
:class:`ForgedDescriptorError` (never a ``TypeError`` or ``KeyError`` from a forged field)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from phaseserve.config import ConfigError
from phaseserve.distributed.protocol import (
    SECRET_ENV,
    ForgedDescriptorError,
    StaleDescriptorError,
    TransferDescriptor,
    deployment_secret,
)
from phaseserve.distributed.transfer import DescriptorAuth

SECRET = "a-deployment-secret-of-some-length"
NOW = 1_800_000_000.0
DESC = TransferDescriptor(request_id="r1", uuid=(7 << 20) + 1, address="10.0.0.5:41234", server_id=12345,
                          pages=(3, 4), tags=(9, 10), length=7, page_size=4, kv_dtype="float8_e4m3fn",
                          leaves=(((8, 1, 3), "float8_e4m3fn"), ((8, 1), "float32")))
# one altered value per field (mac included): each differs from DESC's and is something an attacker could send
TAMPERED = {"request_id": "r2", "uuid": (7 << 20) + 2, "address": "10.6.6.6:41234", "server_id": 12346,
            "pages": (3, 5), "tags": (9, 11), "length": 8, "page_size": 8, "kv_dtype": "bfloat16",
            "leaves": (((16, 1, 3), "float8_e4m3fn"), ((8, 1), "float32")), "expires": NOW + 10_000.0,
            "mac": "0" * 64}


def test_a_genuine_descriptor_verifies():
    auth = DescriptorAuth(SECRET, ttl_s=60.0)
    signed = auth.sign(DESC, now=NOW)
    assert signed.expires == NOW + 60.0 and len(signed.mac) == 64 and DESC.mac == ""
    assert auth.verify(signed, now=NOW + 59.0) is signed
    assert DescriptorAuth(SECRET.encode()).verify(signed, now=NOW) is signed  # the same key as bytes


def test_every_field_is_covered():
    assert set(TAMPERED) == {f.name for f in dataclasses.fields(TransferDescriptor)}


@pytest.mark.parametrize("field", sorted(TAMPERED))
def test_a_tampered_field_is_refused(field):
    auth = DescriptorAuth(SECRET)
    signed = auth.sign(DESC, now=NOW)
    forged = signed.replace(**{field: TAMPERED[field]})
    assert forged != signed
    with pytest.raises(ForgedDescriptorError, match="MAC does not verify") as e:
        auth.verify(forged, now=NOW)
    assert e.value.kind == "forged" and isinstance(e.value, StaleDescriptorError)


@pytest.mark.parametrize("value", [b"bytes", float("nan"), float("inf"), object(), {1, 2}, 7.0, True, None])
def test_unsignable_or_retyped_values_are_refused_typed(value):
    """Arbitrary values in any field (what a forged control message may carry) end as ForgedDescriptorError."""
    auth = DescriptorAuth(SECRET)
    signed = auth.sign(DESC, now=NOW)
    for field in TAMPERED:
        with pytest.raises(ForgedDescriptorError):
            auth.verify(signed.replace(**{field: value}), now=NOW)


def test_unsigned_and_wrong_secret_descriptors_are_refused():
    auth = DescriptorAuth(SECRET)
    with pytest.raises(ForgedDescriptorError, match="MAC"):
        auth.verify(DESC, now=NOW)  # never signed
    other = DescriptorAuth("another-deployment-secret!!")
    with pytest.raises(ForgedDescriptorError, match="MAC"):
        auth.verify(other.sign(DESC, now=NOW), now=NOW)
    with pytest.raises(ForgedDescriptorError, match="not a TransferDescriptor"):
        auth.verify(dataclasses.asdict(auth.sign(DESC, now=NOW)), now=NOW)


def test_a_stale_descriptor_is_refused_even_with_a_valid_mac():
    auth = DescriptorAuth(SECRET, ttl_s=30.0)
    signed = auth.sign(DESC, now=NOW)
    with pytest.raises(ForgedDescriptorError, match="expired") as e:
        auth.verify(signed, now=NOW + 30.0)
    assert e.value.kind == "expired"
    with pytest.raises(ForgedDescriptorError, match="MAC"):  # pushing its expiry forward breaks the MAC
        auth.verify(signed.replace(expires=NOW + 3600.0), now=NOW + 31.0)


def test_the_error_crosses_processes_typed():
    err = ForgedDescriptorError("refused", "expired")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is ForgedDescriptorError and again.kind == "expired" and str(again) == "refused"


def test_the_deployment_secret_comes_from_config_env_or_is_generated(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    generated = deployment_secret()
    assert len(generated) == 64 and deployment_secret() == generated  # once per run, exported for children
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert deployment_secret() == SECRET.encode()
    assert deployment_secret("configured-secret-wins") == b"configured-secret-wins"
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match=SECRET_ENV):
        deployment_secret()
    with pytest.raises(ConfigError):
        DescriptorAuth(b"")
