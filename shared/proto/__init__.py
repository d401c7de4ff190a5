"""Generated protobuf/gRPC modules of the ``encdec.v1`` API.

``decoder_pb2``, ``decoder_pb2_grpc``, ``encoder_pb2`` and ``encoder_pb2_grpc``
(and ``.pyi`` stubs) are generated from ``proto/encdec/v1/*.proto`` when the
package is built or installed (``setup.py`` ``build_py``, also run by
``pip install -e .``). They are never committed or hand-edited. Import them as
``from shared.proto import decoder_pb2``.
"""

import os as _os

_GENERATED = ("decoder_pb2", "decoder_pb2_grpc", "encoder_pb2", "encoder_pb2_grpc")
_missing = [m for m in _GENERATED if not _os.path.exists(_os.path.join(_os.path.dirname(__file__), m + ".py"))]
if _missing:
    raise ImportError(
        f"shared.proto: generated modules {', '.join(_missing)} are missing; "
        "run `pip install -e .` (or scripts/setup.sh) in the repository root to generate them "
        "from proto/encdec/v1/*.proto"
    )
