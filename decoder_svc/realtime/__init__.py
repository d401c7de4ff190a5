"""Realtime transcription: audio streamed in, partial and final text streamed out (``TranscribeStream``).

``stream_audio`` turns the client's PCM chunks into 16 kHz float32, ``stream_vad`` finds utterances with silero-vad
(batched over every live stream), ``agreement`` turns consecutive hypotheses into finals (LocalAgreement-2), and
``realtime_session`` runs one stream's re-decodes as ordinary engine sequences beside every other request.
"""
