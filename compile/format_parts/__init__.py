"""The parts ``compile/formats.py`` joins into weight formats: the codec by rows and with 8 rows
interleaved (``codec``, ``codec_x8``: numpy, no TVM), the CPU kernels' vector TIR pieces
(``cpu``, ``cpu_x8``) and the GPU kernels' scalar ones (``gpu``)."""
