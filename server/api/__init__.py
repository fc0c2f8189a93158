"""The HTTP APIs agentkv speaks, one folder per API (named after its URL): request models
(``protocol``), conversion to chat messages (``convert``), response and stream encoding
(``encode``), and the routes (``router``), each route calling the shared turn
(``server.pipeline.turn``) once. ``deps`` holds the FastAPI dependencies every route takes."""
