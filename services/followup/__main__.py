from yoke.service import run_service

run_service("followup", lambda service: None)
