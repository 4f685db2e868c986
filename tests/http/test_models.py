"""GET /v1/models and /v1/models/{model}: tables, widths, key counts, sources, tiers."""

from __future__ import annotations

import numpy as np

from tests.http.conftest import DIMS, MAX_KEYS, MODEL, TABLE_NAMES, Live


def test_list_models(live: Live) -> None:
    body = live.client.get("/v1/models").json()
    assert body["loading"] == [] and body["failed"] == {}
    (model,) = body["models"]
    assert model["model"] == MODEL and model["ready"] is True
    for i, table in enumerate(model["tables"]):
        assert table["index"] == i
        assert table["name"] == TABLE_NAMES[i]
        assert table["storage_name"] == f"hps_et.{MODEL}.{TABLE_NAMES[i]}"
        assert table["dim"] == DIMS[i]
        assert table["max_keys"] == MAX_KEYS
        assert table["source"]["uri"] == str(live.model.dir / TABLE_NAMES[i])
        assert table["source"]["num_keys"] == len(live.model.keys[i])
        assert table["tiers"]["hash_map"]["keys"] == len(live.model.keys[i])


def test_one_model_and_hit_rates(live: Live) -> None:
    keys = np.concatenate([live.model.keys[0][:30], np.array([-5, -6], np.int64)])
    keys = np.setdiff1d(keys, live.model.keys[0][30:])  # -5, -6 are no keys of the table
    before = live.client.get(f"/v1/models/{MODEL}").json()["tables"][0]["stats"]
    assert live.lookup_binary(0, keys).status_code == 200
    info = live.client.get(f"/v1/models/{MODEL}").json()
    assert info["model"] == MODEL and [t["name"] for t in info["tables"]] == TABLE_NAMES
    stats = info["tables"][0]["stats"]
    assert stats["lookups"] == before["lookups"] + 1
    assert stats["keys"] == before["keys"] + len(keys)
    defaults = int(np.count_nonzero(~np.isin(keys, live.model.keys[0])))
    assert stats["defaults"] == before["defaults"] + defaults
    rate = info["tables"][0]["hit_rate"]
    assert abs(rate["volatile"] + rate["persistent"] + rate["default"] - 1.0) < 1e-9
    assert rate["default"] == stats["defaults"] / stats["keys"]


def test_each_table_says_which_path_answers_its_lookups_and_counts_them(live: Live) -> None:
    def shown() -> dict[str, object]:
        info = live.client.get(f"/v1/models/{MODEL}").json()
        return info["tables"][0]["http_lookup"]  # type: ignore[no-any-return]

    before = shown()
    assert before["path"] == "host" and before["reason"] == "no GPU cache"
    assert "sizes" not in before  # nothing measured: the host tiers are its only path
    assert live.lookup_binary(0, live.model.keys[0][:10]).status_code == 200
    after = shown()
    assert after["answered"] == {"gpu": 0, "host": before["answered"]["host"] + 1}
    metrics = live.client.get("/metrics").text
    line = next(m for m in metrics.splitlines()
                if m.startswith("hps_http_lookups_total{") and f'table="{TABLE_NAMES[0]}"' in m
                and 'path="host"' in m)
    assert float(line.rsplit(" ", 1)[1]) >= after["answered"]["host"]
