from yoke.service import run_service

run_service("guardian", lambda service: None)
