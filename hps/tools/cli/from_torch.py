"""`hps config from-torch CHECKPOINT`: the ps.json block that serves a PyTorch checkpoint's
embedding tables (a `torch.save` state_dict file or a DCP folder, any URI hps reads).

Each table is one 2-D state_dict entry: those named with `--table` (repeat it), else the
ones whose names say they are embeddings (hps/modelfiles/formats/torch_state.py,
`embedding_keys`: TorchRec's `embedding_bags` / `embeddings` collections, any path with
"emb" in it). A table is named as `hps.torch.DeltaPublisher` names it (`table_name_of`:
`ebc.embedding_bags.t_user.weight` → `t_user`, `embedding.weight` → `embedding`), its
width is the tensor's, its keys are the row index + `key_offset`: 0 for every table, or,
with `--stacked-keys`, each table's first key after the last one of the table before (one
key space over all tables, as HugeCTR's slot offsets give). Nothing is read but the
checkpoint's metadata.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from hps.errors import HPSError, ModelFileError
from hps.tools.cli.root import fail


def from_torch(
    checkpoint: str = typer.Argument(
        ..., help="A torch.save state_dict file (.pt, .pth, .bin, .ckpt) or a DCP folder."),
    model: str = typer.Option("model", "--model", "-m", help="The model's name."),
    tables: list[str] = typer.Option(
        [], "--table", "-t",
        help="A state_dict key of a table (repeat the option; default: the embeddings)."),
    stacked_keys: bool = typer.Option(
        False, "--stacked-keys",
        help="Give the tables consecutive key ranges instead of each starting at 0."),
    keys_per_sample: int = typer.Option(
        1, "--keys-per-sample", min=1,
        help="maxnum_catfeature_query_per_table_per_sample of every table."),
) -> None:
    """Print the ps.json block that serves a PyTorch checkpoint's embedding tables."""
    try:
        fmt, shapes = checkpoint_shapes(checkpoint)
        print(json.dumps(ps_block(checkpoint, fmt, shapes, model, tables, stacked_keys,
                                  keys_per_sample), indent=2))
    except HPSError as exc:
        fail(exc)


def checkpoint_shapes(checkpoint: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(format, state_dict key → shape) of a torch.save file or a DCP folder."""
    from hps.modelfiles.formats import detect_format, split_file
    from hps.modelfiles.formats.spec import TableSpec
    from hps.modelfiles.uri import open_source

    fmt = detect_format(TableSpec(path=checkpoint))
    if fmt == "torch":
        from hps.modelfiles.formats.torch_state import read_archive

        folder, name = split_file(checkpoint)
        with open_source(folder) as source:
            return fmt, {k: t.shape for k, t in read_archive(source, name).items()}
    if fmt == "":
        from hps.modelfiles.formats.dcp import read_metadata

        with open_source(checkpoint) as source:
            if source.exists(".metadata"):
                entries = read_metadata(source).state_dict_metadata
                return "dcp", {k: tuple(int(d) for d in v.size) for k, v in entries.items()
                               if hasattr(v, "size")}
    raise ModelFileError(f"{checkpoint} is neither a torch.save file (.pt, .pth, .bin, .ckpt)"
                         " nor a DCP checkpoint folder (.metadata)")


def ps_block(checkpoint: str, fmt: str, shapes: dict[str, tuple[int, ...]], model: str,
             tables: list[str], stacked_keys: bool, keys_per_sample: int) -> dict[str, Any]:
    """The `models` block of ps.json for these tables (see the module docstring)."""
    from hps.modelfiles.formats.torch_state import embedding_keys, table_name_of

    chosen = tables or embedding_keys(shapes)
    listing = ", ".join(f"{k} {list(s)}" for k, s in shapes.items() if len(s) == 2)
    if not chosen:
        raise ModelFileError(f"{checkpoint}: no state_dict key names an embedding (2-D "
                             f"tensors: {listing or 'none'}); name the tables with --table")
    for key in chosen:
        if len(shapes.get(key, ())) != 2:
            raise ModelFileError(f"{checkpoint}: {key!r} is not a 2-D tensor of the "
                                 f"checkpoint (2-D tensors: {listing or 'none'})")
    names = [table_name_of(key) for key in chosen]
    if len(set(names)) != len(names):
        raise ModelFileError(f"{checkpoint}: the tables {chosen} give the names {names}, "
                             "which repeat; pick them with --table")
    files, offset = [], 0
    for key in chosen:
        files.append({"path": checkpoint, "format": fmt, "tensor": key, "key_offset": offset})
        if stacked_keys:
            offset += shapes[key][0]
    return {"models": [{
        "model": model,
        "sparse_files": files,
        "embedding_table_names": names,
        "embedding_vecsize_per_table": [shapes[key][1] for key in chosen],
        "maxnum_catfeature_query_per_table_per_sample": [keys_per_sample] * len(chosen),
        "deployed_device_list": [0],
    }]}
