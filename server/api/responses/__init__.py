"""OpenAI Responses: ``POST /v1/responses``, ``POST /v1/responses/compact``, ``GET /v1/responses/{id}``."""
