"""The browser page the API server serves at `/`: a chat and a server view (static files)."""
