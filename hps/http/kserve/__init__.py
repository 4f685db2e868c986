"""The KServe v2 / Triton inference protocol, as Triton's HPS backend served it.

One v2 model per HPS model, version "1", declared as the HPS backend declared it:

    inputs   KEYS     INT64 [-1]   every table's keys, concatenated in table order
             NUMKEYS  INT32 [-1]   keys per table, in table order (fewer entries than
                                   tables: the tables left out get no keys)
    output   OUTPUT0  FP32  [-1]   the vectors of all keys, rows concatenated in the
                                   same order (Σ NUMKEYS[i] × width[i] floats)

Routes (the KServe v2 protocol Triton speaks): `GET /v2`, `/v2/health/live`, `/v2/health/ready`,
`/v2/models/{model}[/versions/1]` (metadata), `…/ready`, `…/config` (Triton's model
configuration extension) and `POST …/infer`. Tensors come as JSON (`"data"`, flat or
nested, row-major) or through the binary tensor data extension: the body is the JSON
header (`Inference-Header-Content-Length` bytes) followed by each input's raw
little-endian bytes (`"parameters": {"binary_data_size": n}`), and an output asked for
with `"binary_data": true` (or the request parameter `binary_data_output`) is answered
the same way. `tritonclient.http.InferenceServerClient` works as it is.

Errors answer `{"error": "<message>"}` (the protocol's form) with the status of
`errors.status_of`: 400 for a malformed request, 404 for an unknown model or version,
413 for too many keys or too large a body, 401 without the token, 503 while loading.
Health routes are open; every other route needs the token when one is set.

Infer is a hot route (`hot_routes.HotRoute`): it is answered ahead of FastAPI's router,
and parsing, lookups and encoding run on the lookup thread pool.

- schemas.py  what the protocol declares: tensor names and types, the version, the JSON
              request schema, the metadata and configuration bodies, OpenAPI
- parse.py    a request body → `InferCall` (keys, NUMKEYS, the answer's form)
- plan.py     the split of KEYS over the tables, counts checked; OUTPUT0 looked up in place
- encode.py   OUTPUT0 as JSON, or binary after its header in one buffer
- infer.py    the infer route's handler: checks and limits, then parse, plan, encode
- routes.py   the v2 routes as FastAPI declares them
"""
