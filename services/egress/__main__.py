from services.egress.app import register
from yoke.runtime.service import run_service

run_service("egress", register)
