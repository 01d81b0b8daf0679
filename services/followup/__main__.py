from services.followup.app import register
from yoke.service import run_service

run_service("followup", register)
