"""Who may call the server and whose anatomies a caller may read: several API keys, each owning what it made."""

import httpx
import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.errors import AnatomyError
from llm_anatomy.server.auth import Keys, api_keys, load_salt, read_key_file
from test_server import HELLO, MODEL, Running, checkpoint  # noqa: F401 - checkpoint is a fixture

KEY_A, KEY_B = "key-of-alice-0123", "key-of-bob-4567"
GOOD = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)


def test_each_key_reads_only_its_own_anatomies_across_a_restart(engine, tmp_path):
    running = Running(engine, tmp_path, api_keys=(KEY_A, KEY_B))
    try:
        url = running.url
        made_by_a = httpx.post(f"{url}/v1/chat/completions", json=GOOD, headers=auth(KEY_A)).headers["x-anatomy-id"]
        made_by_b = httpx.post(f"{url}/v1/chat/completions", json=GOOD, headers=auth(KEY_B)).headers["x-anatomy-id"]
        for path in (f"/v1/anatomy/{made_by_a}", f"/anatomy/{made_by_a}"):
            assert httpx.get(url + path, headers=auth(KEY_A)).status_code == 200
            other = httpx.get(url + path, headers=auth(KEY_B))
            assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
            # the same answer as for an id that does not exist: nothing tells B that A's record is there
            assert other.json()["error"]["message"].replace(made_by_a, "X") == httpx.get(
                url + path.replace(made_by_a, "0" * 16), headers=auth(KEY_B)).json()["error"]["message"].replace(
                "0" * 16, "X")
        listed_a = [a["id"] for a in httpx.get(f"{url}/v1/anatomy", headers=auth(KEY_A)).json()["data"]]
        listed_b = [a["id"] for a in httpx.get(f"{url}/v1/anatomy", headers=auth(KEY_B)).json()["data"]]
        assert listed_a == [made_by_a] and listed_b == [made_by_b]
        assert httpx.get(f"{url}/v1/anatomy", headers=auth("not-a-key")).status_code == 401
        html = httpx.get(f"{url}/anatomy/{made_by_a}", headers=auth(KEY_A))
        csp = html.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "http" not in csp
        assert html.headers["x-content-type-options"] == "nosniff"
    finally:
        running.stop()
    stored = b"".join(path.read_bytes() for path in tmp_path.glob("anatomies.db*"))
    assert made_by_a.encode() in stored and KEY_A.encode() not in stored and KEY_B.encode() not in stored  # hashes
    again = Running(engine, tmp_path, api_keys=(KEY_B, KEY_A))  # a restart, keys in another order
    try:
        assert httpx.get(f"{again.url}/v1/anatomy/{made_by_a}", headers=auth(KEY_A)).status_code == 200
        assert httpx.get(f"{again.url}/v1/anatomy/{made_by_a}", headers=auth(KEY_B)).status_code == 404
    finally:
        again.stop()
    without_keys = Running(engine, tmp_path)  # the localhost default: every record readable
    try:
        assert httpx.get(f"{without_keys.url}/v1/anatomy/{made_by_b}").status_code == 200
        assert len(httpx.get(f"{without_keys.url}/v1/anatomy").json()["data"]) == 2
    finally:
        without_keys.stop()


def test_keys_are_hashed_with_the_run_directorys_salt(tmp_path):
    salt = load_salt(tmp_path)
    assert load_salt(tmp_path) == salt and len(salt) == 32 and (tmp_path / "owner-salt").stat().st_mode & 0o077 == 0
    keys = Keys((KEY_A, KEY_B), salt)
    assert keys.check(KEY_A) == keys.owner(KEY_A) != keys.check(KEY_B)
    assert keys.check("nope") is None and keys.check("") is None
    assert Keys((KEY_A,), load_salt(tmp_path / "other")).owner(KEY_A) != keys.owner(KEY_A)
    (tmp_path / "owner-salt").write_bytes(b"short")
    with pytest.raises(AnatomyError, match="damaged"):
        load_salt(tmp_path)


def test_api_keys_from_flags_a_file_and_the_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team keys\n{KEY_A}\n\n  {KEY_B}  \n")
    assert read_key_file(key_file) == [KEY_A, KEY_B]
    assert api_keys(["k1"], key_file, "env-key") == ("k1", KEY_A, KEY_B)
    assert api_keys([], None, "env-key") == ("env-key",) and api_keys(None, None, None) == ()
    assert api_keys(["k1", "k1"], None, None) == ("k1",)
    (tmp_path / "empty").write_text("# nothing\n\n")
    for given, path, message in (([" "], None, "empty"), (["two words"], None, "spaces"),
                                 ([], tmp_path / "empty", "holds no key"), ([], tmp_path / "missing", "cannot read")):
        with pytest.raises(AnatomyError, match=message):
            api_keys(given, path, None)
